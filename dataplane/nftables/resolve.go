package nftables

import (
	"slices"
	"strings"

	"github.com/proxyaudit/proxyaudit/audit"
)

// From the tables read to the model: the frontends of the service maps,
// the service chain each goes to, and the endpoints it reaches; the same
// for nft JSON and the tables the collector decodes from the kernel.

// nftSources lists the parsed tables, IPv4 first.
func nftSources(tables map[string]*nftTable) []nftSource {
	var srcs []nftSource
	for _, fam := range []string{"ip", "ip6"} {
		if t := tables[fam]; t != nil {
			srcs = append(srcs, t)
		}
	}
	return srcs
}

// nftSource is kube-proxy's table in one family as a reader decoded it:
// nft's JSON (parsed lazily, chain by chain) or the collector's netlink
// dump (Table). reduceNFT turns either into the observed model.
type nftSource interface {
	familyOf() int
	// dispatches reports whether the services chain still looks up
	// service-ips: without that rule (a flushed table) no service
	// traffic is translated.
	dispatches() bool
	serviceIPs(fn func(audit.FrontendKey, string)) error
	nodePorts(fn func(audit.FrontendKey, string)) error
	noEndpoints(fn func(audit.FrontendKey)) error
	// rules is a chain's rules, each as its statements.
	rules(chain string) [][]Statement
}

func reduceNFT(srcs []nftSource) (*audit.Observed, error) {
	obs := &audit.Observed{Mode: audit.ModeNFTables, RejectsKnown: true, Rejects: map[audit.FrontendKey]bool{}}
	for _, t := range srcs {
		obs.Families = append(obs.Families, t.familyOf())
		if !t.dispatches() {
			// This family's table was flushed: its maps may remain,
			// but nothing looks them up.
			continue
		}
		// Frontends that go to one policy chain share its endpoints, read
		// once (see the iptables reader).
		shared := map[string][]audit.Endpoint{}
		add := func(k audit.FrontendKey, target string) { addFrontend(t, obs, k, target, shared) }
		if err := t.serviceIPs(add); err != nil {
			return nil, err
		}
		if err := t.nodePorts(add); err != nil {
			return nil, err
		}
		if err := t.noEndpoints(func(k audit.FrontendKey) { obs.Rejects[k] = true }); err != nil {
			return nil, err
		}
	}
	obs.NoRules = len(obs.Frontends) == 0
	if len(obs.Families) == 0 {
		obs.Families = []int{4}
	}
	slices.Sort(obs.Families)
	obs.Normalize()
	return obs, nil
}

// addFrontend follows a map element's target to the frontend's policy
// chain and its endpoints: DNATs in the chain (a numgen map or a plain
// address) and in the endpoint chains it goes to (session affinity).
func addFrontend(t nftSource, obs *audit.Observed, key audit.FrontendKey, target string, shared map[string][]audit.Endpoint) {
	scope, policy := nftPolicy(t, target, 0)
	if policy == "" {
		return
	}
	eps, ok := shared[policy]
	if !ok {
		eps = policyEndpoints(t, policy)
		shared[policy] = eps
	}
	obs.Frontends = append(obs.Frontends, audit.ObservedFrontend{FrontendKey: key, Scope: scope, Chain: policy, Name: nftChainName(policy), Endpoints: eps})
}

// policyEndpoints reads a policy chain's endpoints: its DNATs (a numgen
// map or a plain address) and those of the endpoint chains it goes to
// (session affinity), sorted and without repeats.
func policyEndpoints(t nftSource, policy string) []audit.Endpoint {
	// Counted first, so that 100k endpoints are one allocation, not a
	// slice grown ten times.
	type part struct {
		chain string
		rules [][]Statement
	}
	parts := []part{{policy, t.rules(policy)}}
	seen := map[string]bool{}
	n := 0
	for _, rule := range parts[0].rules {
		for _, st := range rule {
			n += len(st.DNAT)
			for _, ch := range st.Gotos {
				if strings.HasPrefix(ch, "endpoint-") && !seen[ch] { // each endpoint chain once
					seen[ch] = true
					parts = append(parts, part{ch, t.rules(ch)})
				}
			}
		}
	}
	for _, p := range parts[1:] {
		for _, rule := range p.rules {
			for _, st := range rule {
				n += len(st.DNAT)
			}
		}
	}
	eps := make([]audit.Endpoint, 0, n)
	for _, p := range parts {
		for _, rule := range p.rules {
			for _, st := range rule {
				for _, a := range st.DNAT {
					eps = append(eps, audit.Endpoint{Addr: a, Weight: -1, Chain: p.chain})
				}
			}
		}
	}
	return audit.SortEndpoints(eps)
}

// nftPolicy follows an external-… chain to the service-… (cluster) or
// local-… chain its last unconditional goto names.
func nftPolicy(t nftSource, chain string, depth int) (audit.Scope, string) {
	switch {
	case depth > 3:
		return "", ""
	case strings.HasPrefix(chain, "service-"):
		return audit.ScopeCluster, chain
	case strings.HasPrefix(chain, "local-"):
		return audit.ScopeLocal, chain
	case strings.HasPrefix(chain, "external-"):
		rules := t.rules(chain)
		for i := len(rules) - 1; i >= 0; i-- {
			if sts := rules[i]; len(sts) == 1 && len(sts[0].Gotos) == 1 && sts[0].Verdict {
				return nftPolicy(t, sts[0].Gotos[0], depth+1)
			}
		}
	}
	return "", ""
}

// nftChainName turns "service-HASH-ns/name/proto/port" into "ns/name:port".
func nftChainName(chain string) string {
	_, rest, ok := strings.Cut(chain, "-")
	if !ok {
		return ""
	}
	_, rest, ok = strings.Cut(rest, "-")
	if !ok {
		return ""
	}
	parts := strings.Split(rest, "/")
	if len(parts) != 4 {
		return ""
	}
	if parts[3] == "" {
		return parts[0] + "/" + parts[1]
	}
	return parts[0] + "/" + parts[1] + ":" + parts[3]
}
