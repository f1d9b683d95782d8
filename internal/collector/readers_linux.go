package collector

import "github.com/proxyaudit/proxyaudit/dataplane/nftables"

// What the collector asks of nftables' kernel reader.
var (
	_ ChangeReader     = (*nftables.NetlinkReader)(nil)
	_ NoEndpointReader = (*nftables.NetlinkReader)(nil)
	_ FlushProbe       = (*nftables.NetlinkReader)(nil)
	_ NotificationSink = (*nftables.NetlinkReader)(nil)
)
