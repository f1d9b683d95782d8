package collector

import (
	"github.com/proxyaudit/proxyaudit/dataplane/iptables"
	"github.com/proxyaudit/proxyaudit/dataplane/nftables"
)

// What the collector asks of the modes' kernel readers.
var (
	_ ChangeReader     = (*iptables.NFTReader)(nil)
	_ FlushProbe       = (*iptables.NFTReader)(nil)
	_ NotificationSink = (*iptables.NFTReader)(nil)
	_ ChangeReader     = (*iptables.LegacyReader)(nil)
	_ FlushProbe       = (*iptables.LegacyReader)(nil)
	_ ChangeSignal     = (*iptables.LegacySignal)(nil)
	_ IPTables         = iptables.KernelChains(false, false)

	_ ChangeReader     = (*nftables.NetlinkReader)(nil)
	_ NoEndpointReader = (*nftables.NetlinkReader)(nil)
	_ FlushProbe       = (*nftables.NetlinkReader)(nil)
	_ NotificationSink = (*nftables.NetlinkReader)(nil)
)
