package nftables

import "github.com/proxyaudit/proxyaudit/audit"

// Table is kube-proxy's nftables table in one family as a reader other
// than nft's JSON decoded it (the collector's netlink reader): the maps
// the audit reads and the rules of every chain. FromTables reduces it
// exactly as Parse reduces nft's JSON.
type Table struct {
	Family int
	// Dispatches: the services chain looks up the service-ips map (a
	// flushed table has no such rule).
	Dispatches bool
	// ServiceIPs and NodePorts are the service-ips and service-nodeports
	// map elements: a frontend and the chain it goes to.
	ServiceIPs, NodePorts []MapEntry
	// NoEndpoints are the keys of the no-endpoint-services and
	// no-endpoint-nodeports maps.
	NoEndpoints []audit.FrontendKey
	// Chains are every chain's rules, each as its statements.
	Chains map[string][][]Statement
}

// MapEntry is a verdict-map element: a frontend and its goto target.
type MapEntry struct {
	Key    audit.FrontendKey
	Target string
}

// FromTables reduces decoded nftables tables (one per family) to the
// observed model.
func FromTables(tables ...*Table) (*audit.Observed, error) {
	srcs := make([]nftSource, len(tables))
	for i, t := range tables {
		srcs[i] = t
	}
	return reduceNFT(srcs)
}

func (t *Table) familyOf() int    { return t.Family }
func (t *Table) dispatches() bool { return t.Dispatches }

func (t *Table) serviceIPs(fn func(audit.FrontendKey, string)) error {
	for _, e := range t.ServiceIPs {
		fn(e.Key, e.Target)
	}
	return nil
}

func (t *Table) nodePorts(fn func(audit.FrontendKey, string)) error {
	for _, e := range t.NodePorts {
		fn(e.Key, e.Target)
	}
	return nil
}

func (t *Table) noEndpoints(fn func(audit.FrontendKey)) error {
	for _, k := range t.NoEndpoints {
		fn(k)
	}
	return nil
}

func (t *Table) rules(chain string) [][]Statement { return t.Chains[chain] }
