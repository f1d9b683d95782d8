package audit

// NFTTable is kube-proxy's nftables table in one family as a reader other
// than nft's JSON decoded it (the collector's netlink reader): the maps
// the audit reads and the rules of every chain. FromNFTables reduces it
// exactly as ParseNFTables reduces nft's JSON.
type NFTTable struct {
	Family int
	// Dispatches: the services chain looks up the service-ips map (a
	// flushed table has no such rule).
	Dispatches bool
	// ServiceIPs and NodePorts are the service-ips and service-nodeports
	// map elements: a frontend and the chain it goes to.
	ServiceIPs, NodePorts []NFTMapEntry
	// NoEndpoints are the keys of the no-endpoint-services map.
	NoEndpoints []FrontendKey
	// Chains are every chain's rules, each as its statements.
	Chains map[string][][]NFTStatement
}

// NFTMapEntry is a verdict-map element: a frontend and its goto target.
type NFTMapEntry struct {
	Key    FrontendKey
	Target string
}

// FromNFTables reduces decoded nftables tables (one per family) to the
// observed model.
func FromNFTables(tables ...*NFTTable) (*Observed, error) {
	srcs := make([]nftSource, len(tables))
	for i, t := range tables {
		srcs[i] = t
	}
	return reduceNFT(srcs)
}

func (t *NFTTable) familyOf() int    { return t.Family }
func (t *NFTTable) dispatches() bool { return t.Dispatches }

func (t *NFTTable) serviceIPs(fn func(FrontendKey, string)) error {
	for _, e := range t.ServiceIPs {
		fn(e.Key, e.Target)
	}
	return nil
}

func (t *NFTTable) nodePorts(fn func(FrontendKey, string)) error {
	for _, e := range t.NodePorts {
		fn(e.Key, e.Target)
	}
	return nil
}

func (t *NFTTable) noEndpoints(fn func(FrontendKey)) error {
	for _, k := range t.NoEndpoints {
		fn(k)
	}
	return nil
}

func (t *NFTTable) rules(chain string) [][]NFTStatement { return t.Chains[chain] }
