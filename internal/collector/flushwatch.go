package collector

import (
	"context"
)

// FlushProbe is a reader that can tell, cheaply and between reads, that
// the node's rules were flushed since its last read: the dispatch every
// service is reached through (iptables' KUBE-SERVICES, the nftables
// services chain, IPVS's virtual servers) emptied or cut to half, or its
// table deleted. Such a change breaks every service through the node,
// and the read that shows it is cheap (the table is empty): it is made at
// once, whatever the read budget or the gap between reads holds. Reads of
// kube-proxy's own syncs, which rewrite the dispatch whole in one commit,
// never trip it.
//
// Flushed is called from the collector's loop, never during a read; it
// may ask the kernel (a first part of one dump, a getsockopt), never read
// a table.
type FlushProbe interface {
	Flushed(ctx context.Context) bool
}
