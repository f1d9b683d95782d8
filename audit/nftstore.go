package audit

import (
	"slices"
	"strings"
)

// NFTablesKube is kube-proxy's nftables table in one IP family as the audit
// reads it, kept map by map and chain by chain so that a reader can
// replace only what a commit changed (SetChain, DeleteChain, SetMaps) and
// learn which frontends that changed (Changes) instead of reducing the
// whole table. Observed is exactly what FromNFTables builds from the same
// table. It is not safe for concurrent use.
type NFTablesKube struct {
	// OmitEndpointChains leaves Endpoint.Chain empty in Changes (a
	// reader that streams the model never sends those names).
	OmitEndpointChains bool

	fam         int
	dispatches  bool
	serviceIPs  map[FrontendKey]string
	nodePorts   map[FrontendKey]string
	noEndpoints map[FrontendKey]bool
	chains      map[string][][]NFTStatement

	// fronts is where each frontend went as of the last Changes (nil
	// before the first).
	fronts      map[FrontendKey]front
	mapsDirty   bool
	dirtyChains map[string]bool
}

// NewNFTablesKube returns an empty table of IP family fam (4 or 6).
func NewNFTablesKube(fam int) *NFTablesKube {
	return &NFTablesKube{fam: fam, serviceIPs: map[FrontendKey]string{}, nodePorts: map[FrontendKey]string{},
		noEndpoints: map[FrontendKey]bool{}, chains: map[string][][]NFTStatement{}, dirtyChains: map[string]bool{}}
}

// NFTablesKubeOf keeps a decoded table.
func NFTablesKubeOf(t *NFTTable) *NFTablesKube {
	k := NewNFTablesKube(t.Family)
	k.SetMaps(t.Dispatches, t.ServiceIPs, t.NodePorts, t.NoEndpoints)
	for name, rules := range t.Chains {
		k.SetChain(name, rules)
	}
	return k
}

// SetChain replaces a chain's rules (none: the chain is empty or gone).
func (k *NFTablesKube) SetChain(name string, rules [][]NFTStatement) {
	old, had := k.chains[name]
	if len(rules) == 0 {
		if !had {
			return
		}
		delete(k.chains, name)
	} else {
		if had && slices.EqualFunc(old, rules, sameStatements) {
			return // rewritten with what it held, as kube-proxy's syncs do
		}
		k.chains[name] = rules
	}
	if k.fronts != nil {
		k.dirtyChains[name] = true
	}
}

// DeleteChain removes a chain.
func (k *NFTablesKube) DeleteChain(name string) { k.SetChain(name, nil) }

func sameStatements(a, b []NFTStatement) bool {
	return slices.EqualFunc(a, b, func(x, y NFTStatement) bool {
		return x.Verdict == y.Verdict && slices.Equal(x.DNAT, y.DNAT) && slices.Equal(x.Gotos, y.Gotos)
	})
}

// SetMaps replaces the table's maps: whether the services chain looks up
// service-ips (a flushed table's does not), the service-ips and
// service-nodeports elements, and the no-endpoint-services keys.
func (k *NFTablesKube) SetMaps(dispatches bool, serviceIPs, nodePorts []NFTMapEntry, noEndpoints []FrontendKey) {
	k.dispatches = dispatches
	k.serviceIPs = mapOf(serviceIPs)
	k.nodePorts = mapOf(nodePorts)
	clear(k.noEndpoints)
	for _, key := range noEndpoints {
		k.noEndpoints[key] = true
	}
	k.mapsDirty = true
}

func mapOf(entries []NFTMapEntry) map[FrontendKey]string {
	m := make(map[FrontendKey]string, len(entries))
	for _, e := range entries {
		if _, ok := m[e.Key]; !ok { // the first, as the reducer keeps it
			m[e.Key] = e.Target
		}
	}
	return m
}

// The table as the reducer reads it.
func (k *NFTablesKube) familyOf() int                       { return k.fam }
func (k *NFTablesKube) rules(chain string) [][]NFTStatement { return k.chains[chain] }

type nftKubeSource struct{ *NFTablesKube }

func (s nftKubeSource) dispatches() bool { return s.NFTablesKube.dispatches }

func (s nftKubeSource) serviceIPs(fn func(FrontendKey, string)) error {
	for key, target := range s.NFTablesKube.serviceIPs {
		fn(key, target)
	}
	return nil
}

func (s nftKubeSource) nodePorts(fn func(FrontendKey, string)) error {
	for key, target := range s.NFTablesKube.nodePorts {
		fn(key, target)
	}
	return nil
}

func (s nftKubeSource) noEndpoints(fn func(FrontendKey)) error {
	for key := range s.NFTablesKube.noEndpoints {
		fn(key)
	}
	return nil
}

// Observed is the whole model of the table, as FromNFTables builds it.
func (k *NFTablesKube) Observed() (*Observed, error) {
	return reduceNFT([]nftSource{nftKubeSource{k}})
}

// frontTable maps every frontend of the maps to its policy chain and
// scope (none when the table does not dispatch).
func (k *NFTablesKube) frontTable() map[FrontendKey]front {
	out := make(map[FrontendKey]front, len(k.serviceIPs)+len(k.nodePorts))
	if !k.dispatches {
		return out
	}
	src := nftKubeSource{k}
	add := func(key FrontendKey, target string) {
		if _, ok := out[key]; ok {
			return
		}
		if scope, policy := nftPolicy(src, target, 0); policy != "" {
			out[key] = front{scope: scope, policy: policy, name: nftChainName(policy)}
		}
	}
	for key, target := range k.serviceIPs {
		add(key, target)
	}
	for key, target := range k.nodePorts {
		add(key, target)
	}
	return out
}

// Changes returns the frontends that changed since the last call (all of
// them at the first), sorted by key, and the keys of those that are gone.
// A frontend changed when its map element now goes elsewhere, when its
// policy chain changed, or when an endpoint chain that chain goes to did.
func (k *NFTablesKube) Changes() (changed []ObservedFrontend, removed []FrontendKey) {
	first := k.fronts == nil
	dirty := map[FrontendKey]bool{}
	redo := first || k.mapsDirty
	for chain := range k.dirtyChains {
		// An external-… chain's last goto picks the policy.
		redo = redo || strings.HasPrefix(chain, "external-")
	}
	if redo {
		next := k.frontTable()
		for key, f := range k.fronts {
			if g, ok := next[key]; !ok {
				removed = append(removed, key)
			} else if g != f {
				dirty[key] = true
			}
		}
		for key := range next {
			if _, ok := k.fronts[key]; !ok {
				dirty[key] = true
			}
		}
		k.fronts = next
	}
	// A policy chain changed when it did or an endpoint chain it goes to
	// did (session affinity).
	endpoints := false
	for chain := range k.dirtyChains {
		endpoints = endpoints || strings.HasPrefix(chain, "endpoint-")
	}
	policyDirty := map[string]bool{}
	isDirty := func(policy string) bool {
		d, ok := policyDirty[policy]
		if ok {
			return d
		}
		d = k.dirtyChains[policy]
		if !d && endpoints {
			for _, rule := range k.chains[policy] {
				for _, st := range rule {
					for _, g := range st.Gotos {
						d = d || k.dirtyChains[g]
					}
				}
			}
		}
		policyDirty[policy] = d
		return d
	}
	src := nftKubeSource{k}
	shared := map[string][]Endpoint{}
	for key, f := range k.fronts {
		if !first && !dirty[key] && !isDirty(f.policy) {
			continue
		}
		eps, ok := shared[f.policy]
		if !ok {
			eps = policyEndpoints(src, f.policy)
			if k.OmitEndpointChains {
				for i := range eps {
					eps[i].Chain = ""
				}
			}
			shared[f.policy] = eps
		}
		changed = append(changed, ObservedFrontend{FrontendKey: key, Scope: f.scope, Chain: f.policy, Name: f.name, Endpoints: eps})
	}
	slices.SortFunc(changed, func(a, b ObservedFrontend) int { return a.FrontendKey.compare(b.FrontendKey) })
	slices.SortFunc(removed, FrontendKey.compare)
	k.mapsDirty = false
	clear(k.dirtyChains)
	return changed, removed
}

// Len is the number of frontends as of the last Changes (0 for a nil
// table).
func (k *NFTablesKube) Len() int {
	if k == nil {
		return 0
	}
	return len(k.fronts)
}

// front is where a frontend's dispatch sends it: the policy (service)
// chain that picks an endpoint, its scope, and the service's name.
type front struct {
	scope  Scope
	policy string
	name   string
}
