package iptables

import (
	"slices"
	"strings"

	"github.com/proxyaudit/proxyaudit/audit"
)

// From the chains read to the model: which frontends the dispatch chains
// hold, the policy chain each goes to, and the endpoints it reaches.

// families lists the IP families of the dump's service and DNAT
// addresses, ascending.
func (p *parser) families() []int {
	var seen [7]bool
	for _, r := range p.rules[keyString("KUBE-SERVICES")] {
		if r.dst.IsValid() {
			seen[audit.Family(r.dst)] = true
		}
	}
	for _, t := range p.targets {
		seen[audit.Family(t.Addr())] = true
	}
	return audit.FamilyList(seen)
}

// resolve builds the observed model of one family's dump.
func (p *parser) resolve(sawFilter bool, fam int) *audit.Observed {
	p.flushPolicy()
	o := p.observed(fam, p.frontTable(fam))
	if sawFilter {
		o.RejectsKnown = true
		o.Rejects = map[audit.FrontendKey]bool{}
		for _, r := range p.filterSvc {
			if r.jump == "REJECT" && r.dst.IsValid() && r.hasDport {
				o.Rejects[audit.FrontendKey{IP: r.dst, Protocol: r.proto, Port: r.dport}] = true
			}
		}
	}
	return o
}

// front is where a frontend's dispatch rule sends it: the policy chain
// that picks an endpoint (KUBE-SVC-… or KUBE-SVL-…), its scope, and the
// service's name from the rule's comment.
type front struct {
	scope  audit.Scope
	policy string
	name   string
}

var (
	keyServices  = keyString("KUBE-SERVICES")
	keyNodePorts = keyString("KUBE-NODEPORTS")
)

// frontTable maps every frontend of the dispatch chains (KUBE-SERVICES,
// then KUBE-NODEPORTS) to where it goes. Of two rules for one frontend
// the first counts, as in the kernel; a rule that reaches no policy chain
// (a jump to KUBE-MARK-MASQ, say) claims nothing.
func (p *parser) frontTable(fam int) map[audit.FrontendKey]front {
	svc, np := p.rules[keyServices], p.rules[keyNodePorts]
	out := make(map[audit.FrontendKey]front, len(svc)+len(np))
	// Each chain is followed once, however many frontends jump to it: a
	// dump whose external chain is long and shared would otherwise cost
	// frontends × its length.
	type reached struct {
		scope  audit.Scope
		policy string
	}
	memo := map[string]reached{}
	add := func(key audit.FrontendKey, r iptRule) {
		if _, ok := out[key]; ok {
			return
		}
		to, ok := memo[r.jump]
		if !ok {
			to.scope, to.policy = p.policyOf(r.jump, 0)
			memo[r.jump] = to
		}
		if to.policy != "" {
			out[key] = front{scope: to.scope, policy: to.policy, name: commentName(r.comment)}
		}
	}
	for _, r := range svc {
		if r.dst.IsValid() && r.hasDport && r.proto != "" {
			add(audit.FrontendKey{IP: r.dst, Protocol: r.proto, Port: r.dport}, r)
		}
	}
	for _, r := range np {
		if r.hasDport && r.proto != "" {
			add(audit.NodePortKey(fam, r.proto, r.dport), r)
		}
	}
	return out
}

// endpointsOf is what a policy chain's jumps reach: each endpoint chain's
// DNAT targets, sorted. An endpoint chain without DNAT routes nothing.
func (p *parser) endpointsOf(policy string) []audit.Endpoint {
	seps := p.policy[keyString(policy)]
	eps := make([]audit.Endpoint, 0, len(seps))
	for _, sep := range seps {
		ti, ok := p.lookupDNAT(sep)
		if !ok {
			continue
		}
		name := ""
		if !p.omitChains {
			name = p.sepName(sep)
		}
		eps = append(eps, audit.Endpoint{Addr: p.targets[ti], Weight: -1, Chain: name})
		for _, more := range p.moreDNAT[sep] {
			eps = append(eps, audit.Endpoint{Addr: more, Weight: -1, Chain: name})
		}
	}
	return audit.SortEndpoints(eps)
}

// observed builds the model of the frontends in fronts, sorted by key.
// Frontends that go to one policy chain share its endpoints: read once,
// one slice (kube-proxy points a few frontends at a chain; a dump pointing
// thousands at one costs no more than the dump's size).
func (p *parser) observed(fam int, fronts map[audit.FrontendKey]front) *audit.Observed {
	o := &audit.Observed{Mode: audit.ModeIPTables, Families: []int{fam}, Frontends: p.frontends(fronts, nil)}
	o.NoRules = len(o.Frontends) == 0
	return o
}

// frontends builds the observed frontends of the keys in fronts that
// want says (all when want is nil), sorted by key.
func (p *parser) frontends(fronts map[audit.FrontendKey]front, want func(audit.FrontendKey, front) bool) []audit.ObservedFrontend {
	shared := map[string][]audit.Endpoint{}
	var out []audit.ObservedFrontend
	for key, f := range fronts {
		if want != nil && !want(key, f) {
			continue
		}
		eps, ok := shared[f.policy]
		if !ok {
			eps = p.endpointsOf(f.policy)
			shared[f.policy] = eps
		}
		out = append(out, audit.ObservedFrontend{FrontendKey: key, Scope: f.scope, Chain: f.policy, Name: f.name, Endpoints: eps})
	}
	slices.SortFunc(out, func(a, b audit.ObservedFrontend) int { return a.FrontendKey.Compare(b.FrontendKey) })
	return out
}

// iptPolicy follows a frontend's jump to the policy chain that picks an
// endpoint: KUBE-SVC (cluster) or KUBE-SVL (local). KUBE-FW filters and then
// jumps to KUBE-EXT; KUBE-EXT short-circuits local and pod traffic to
// KUBE-SVC and ends with an unconditional jump to its policy chain.
func (p *parser) policyOf(chain string, depth int) (audit.Scope, string) {
	if depth > 4 {
		return "", ""
	}
	switch {
	case strings.HasPrefix(chain, "KUBE-SVC-"):
		return audit.ScopeCluster, chain
	case strings.HasPrefix(chain, "KUBE-SVL-"):
		return audit.ScopeLocal, chain
	case strings.HasPrefix(chain, "KUBE-FW-"), strings.HasPrefix(chain, "KUBE-EXT-"):
		rules := p.rules[keyString(chain)]
		for i := len(rules) - 1; i >= 0; i-- {
			r := rules[i]
			p.walked++
			if strings.HasPrefix(r.jump, "KUBE-EXT-") || strings.HasPrefix(r.jump, "KUBE-SVC-") || strings.HasPrefix(r.jump, "KUBE-SVL-") {
				if !r.cond || strings.HasPrefix(chain, "KUBE-FW-") {
					return p.policyOf(r.jump, depth+1)
				}
			}
		}
	}
	return "", ""
}

// commentName extracts "ns/name:port" from a kube-proxy rule comment such as
// "ns/name:port cluster IP".
func commentName(c string) string {
	name, _, _ := strings.Cut(c, " ")
	if strings.Count(name, "/") != 1 {
		return ""
	}
	return name
}
