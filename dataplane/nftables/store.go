package nftables

import (
	"slices"
	"strings"

	"github.com/proxyaudit/proxyaudit/audit"
)

// Kube is kube-proxy's nftables table in one IP family as the audit
// reads it, kept map by map and chain by chain so that a reader can
// replace only what a commit changed (SetChain, DeleteChain, SetMaps) and
// learn which frontends that changed (Changes) instead of reducing the
// whole table. audit.Observed is exactly what FromTables builds from the same
// table. It is not safe for concurrent use.
type Kube struct {
	// OmitEndpointChains leaves audit.Endpoint.Chain empty in Changes (a
	// reader that streams the model never sends those names).
	OmitEndpointChains bool

	fam         int
	dispatches  bool
	serviceIPs  map[audit.FrontendKey]string
	nodePorts   map[audit.FrontendKey]string
	noEndpoints map[audit.FrontendKey]bool
	chains      map[string][][]Statement

	// fronts is where each frontend went as of the last Changes (nil
	// before the first).
	fronts      map[audit.FrontendKey]front
	mapsDirty   bool
	dirtyChains map[string]bool
}

// NewKube returns an empty table of IP family fam (4 or 6).
func NewKube(fam int) *Kube {
	return &Kube{fam: fam, serviceIPs: map[audit.FrontendKey]string{}, nodePorts: map[audit.FrontendKey]string{},
		noEndpoints: map[audit.FrontendKey]bool{}, chains: map[string][][]Statement{}, dirtyChains: map[string]bool{}}
}

// KubeOf keeps a decoded table.
func KubeOf(t *Table) *Kube {
	k := NewKube(t.Family)
	k.SetMaps(t.Dispatches, t.ServiceIPs, t.NodePorts, t.NoEndpoints)
	for name, rules := range t.Chains {
		k.SetChain(name, rules)
	}
	return k
}

// SetChain replaces a chain's rules (none: the chain is empty or gone).
func (k *Kube) SetChain(name string, rules [][]Statement) {
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
func (k *Kube) DeleteChain(name string) { k.SetChain(name, nil) }

func sameStatements(a, b []Statement) bool {
	return slices.EqualFunc(a, b, func(x, y Statement) bool {
		return x.Verdict == y.Verdict && slices.Equal(x.DNAT, y.DNAT) && slices.Equal(x.Gotos, y.Gotos)
	})
}

// SetMaps replaces the table's maps: whether the services chain looks up
// service-ips (a flushed table's does not), the service-ips and
// service-nodeports elements, and the no-endpoint-services keys.
func (k *Kube) SetMaps(dispatches bool, serviceIPs, nodePorts []MapEntry, noEndpoints []audit.FrontendKey) {
	k.dispatches = dispatches
	k.serviceIPs = mapOf(serviceIPs)
	k.nodePorts = mapOf(nodePorts)
	clear(k.noEndpoints)
	for _, key := range noEndpoints {
		k.noEndpoints[key] = true
	}
	k.mapsDirty = true
}

func mapOf(entries []MapEntry) map[audit.FrontendKey]string {
	m := make(map[audit.FrontendKey]string, len(entries))
	for _, e := range entries {
		if _, ok := m[e.Key]; !ok { // the first, as the reducer keeps it
			m[e.Key] = e.Target
		}
	}
	return m
}

// The table as the reducer reads it.
func (k *Kube) familyOf() int                    { return k.fam }
func (k *Kube) rules(chain string) [][]Statement { return k.chains[chain] }

type nftKubeSource struct{ *Kube }

func (s nftKubeSource) dispatches() bool { return s.Kube.dispatches }

func (s nftKubeSource) serviceIPs(fn func(audit.FrontendKey, string)) error {
	for key, target := range s.Kube.serviceIPs {
		fn(key, target)
	}
	return nil
}

func (s nftKubeSource) nodePorts(fn func(audit.FrontendKey, string)) error {
	for key, target := range s.Kube.nodePorts {
		fn(key, target)
	}
	return nil
}

func (s nftKubeSource) noEndpoints(fn func(audit.FrontendKey)) error {
	for key := range s.Kube.noEndpoints {
		fn(key)
	}
	return nil
}

// Observed is the whole model of the table, as FromTables builds it.
func (k *Kube) Observed() (*audit.Observed, error) {
	return reduceNFT([]nftSource{nftKubeSource{k}})
}

// frontTable maps every frontend of the maps to its policy chain and
// scope (none when the table does not dispatch).
func (k *Kube) frontTable() map[audit.FrontendKey]front {
	out := make(map[audit.FrontendKey]front, len(k.serviceIPs)+len(k.nodePorts))
	if !k.dispatches {
		return out
	}
	src := nftKubeSource{k}
	add := func(key audit.FrontendKey, target string) {
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
func (k *Kube) Changes() (changed []audit.ObservedFrontend, removed []audit.FrontendKey) {
	first := k.fronts == nil
	dirty := map[audit.FrontendKey]bool{}
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
	shared := map[string][]audit.Endpoint{}
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
		changed = append(changed, audit.ObservedFrontend{FrontendKey: key, Scope: f.scope, Chain: f.policy, Name: f.name, Endpoints: eps})
	}
	slices.SortFunc(changed, func(a, b audit.ObservedFrontend) int { return a.FrontendKey.Compare(b.FrontendKey) })
	slices.SortFunc(removed, audit.FrontendKey.Compare)
	k.mapsDirty = false
	clear(k.dirtyChains)
	return changed, removed
}

// Len is the number of frontends as of the last Changes (0 for a nil
// table).
func (k *Kube) Len() int {
	if k == nil {
		return 0
	}
	return len(k.fronts)
}

// front is where a frontend's dispatch sends it: the policy (service)
// chain that picks an endpoint, its scope, and the service's name.
type front struct {
	scope  audit.Scope
	policy string
	name   string
}
