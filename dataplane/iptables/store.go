package iptables

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/proxyaudit/proxyaudit/audit"
)

// Rule is what one iptables rule says that the audit reads, for a
// reader that decodes the kernel's rules instead of iptables-save's text
// (the collector's netlink and getsockopt readers). Each field is what
// Parse takes from the same rule's text, so both build the same
// model.
type Rule struct {
	// Dst is the one destination address the rule matches (-d a/32).
	Dst netip.Addr
	// Cond: the rule also matches on something that narrows which packets
	// take it (-s, ! -d, a destination prefix, --src-type).
	Cond bool
	// Proto is the protocol matched (-p): TCP, UDP, SCTP, or another
	// name in upper case; "" when none.
	Proto string
	// DPort is the destination port matched (--dport), when HasDPort.
	DPort    uint16
	HasDPort bool
	// Jump is the rule's target: a chain it jumps to (-j) or goes to (-g,
	// then Goto), or a target such as DNAT or MARK; "" when none.
	Jump string
	Goto bool
	// Comment is the rule's comment (-m comment).
	Comment string
	// DNAT is where a DNAT target sends the packet (--to-destination
	// addr:port); invalid for other targets.
	DNAT netip.AddrPort
}

// NAT is one IP family's iptables nat table as the audit reads it,
// kept chain by chain so that a reader can replace only the chains a
// commit changed (SetChain, DeleteChain) and learn which frontends that
// changed (Changes) instead of rebuilding the whole model. audit.Observed is the
// whole model, exactly what ParseFamily builds from iptables-save
// output of the same rules.
//
// It holds only what the audit reads: endpoint chains as their DNAT
// targets, policy chains as their jumps to endpoint chains, and the
// dispatch chains' rules in full. It is not safe for concurrent use.
type NAT struct {
	// OmitEndpointChains leaves audit.Endpoint.Chain empty in Changes and
	// Observed: a reader that streams the model never sends those names
	// (100k strings at 10k services).
	OmitEndpointChains bool

	fam int
	p   *parser
	// fronts is the frontend table as of the last Changes (nil before).
	fronts map[audit.FrontendKey]front
	// What changed since the last Changes.
	dispatchDirty bool
	dirtyPolicy   map[string]bool
	dirtySEP      map[sepID]bool
}

// NewNAT returns an empty table of IP family fam (4 or 6).
func NewNAT(fam int) *NAT {
	return &NAT{fam: fam, p: newParser(), dirtyPolicy: map[string]bool{}, dirtySEP: map[sepID]bool{}}
}

func newParser() *parser {
	return &parser{rules: map[chainKey][]iptRule{}, policy: map[chainKey][]sepID{}}
}

// Family is the table's IP family.
func (t *NAT) Family() int { return t.fam }

// ErrTooManyChainNames means a table kept up to date chain by chain has
// seen more endpoint chains with names kube-proxy does not make than it
// remembers: read it whole into a new table.
var ErrTooManyChainNames = errors.New("too many endpoint chains with names kube-proxy does not make: read the table whole")

// maxOtherNames bounds the endpoint chain names outside kube-proxy's form
// a table remembers (each costs its name; they are not forgotten when the
// chain goes, as a policy chain may still jump to it).
const maxOtherNames = 1 << 16

// chain kinds, by name.
const (
	chainOther = iota
	chainSEP
	chainPolicy
	chainDispatch
)

func chainKind(name string) int {
	switch {
	case !strings.HasPrefix(name, "KUBE-"):
		return chainOther
	case strings.HasPrefix(name, "KUBE-SEP-"):
		return chainSEP
	case strings.HasPrefix(name, "KUBE-SVC-"), strings.HasPrefix(name, "KUBE-SVL-"):
		return chainPolicy
	case name == "KUBE-SERVICES", name == "KUBE-NODEPORTS", strings.HasPrefix(name, "KUBE-EXT-"), strings.HasPrefix(name, "KUBE-FW-"):
		return chainDispatch
	}
	return chainOther
}

// Reads says whether the audit reads chain name's rules: a reader need
// not decode (or follow changes to) any other chain.
func Reads(chain string) bool { return chainKind(chain) != chainOther }

// SetChain replaces chain name's rules (an empty list empties it). Chains
// the audit does not read are ignored.
func (t *NAT) SetChain(name string, rules []Rule) error {
	kind := chainKind(name)
	if kind == chainOther {
		return nil
	}
	k, ok := keyOf([]byte(name))
	if !ok {
		return fmt.Errorf("chain name %q is longer than iptables allows", clip([]byte(name)))
	}
	p := t.p
	n, old := 0, 0
	switch kind {
	case chainSEP:
		if len(p.otherNames) >= maxOtherNames {
			return ErrTooManyChainNames
		}
		id := p.sepIDOf([]byte(name))
		var was []netip.AddrPort
		if idx, ok := p.lookupDNAT(id); ok {
			old = 1 + len(p.moreDNAT[id])
			was = append([]netip.AddrPort{p.targets[idx]}, p.moreDNAT[id]...)
		}
		var targets []netip.AddrPort
		for _, r := range rules {
			if r.DNAT.IsValid() {
				targets = append(targets, netip.AddrPortFrom(r.DNAT.Addr().Unmap(), r.DNAT.Port()))
			}
		}
		n = len(targets)
		if slices.Equal(was, targets) {
			break // rewritten with what it held, as kube-proxy's syncs do
		}
		p.putDNAT(id, targets)
		if t.fronts != nil {
			t.dirtySEP[id] = true
		}
	case chainPolicy:
		old = len(p.policy[k])
		var seps []sepID
		for _, r := range rules {
			if !r.Goto && strings.HasPrefix(r.Jump, "KUBE-SEP-") {
				if len(p.otherNames) >= maxOtherNames {
					return ErrTooManyChainNames
				}
				seps = append(seps, p.sepIDOf([]byte(r.Jump)))
			}
		}
		n = len(seps)
		if slices.Equal(seps, p.policy[k]) {
			break
		}
		if len(seps) == 0 {
			delete(p.policy, k)
		} else {
			p.policy[k] = seps
		}
		if t.fronts != nil {
			t.dirtyPolicy[name] = true
		}
	case chainDispatch:
		old = len(p.rules[k])
		rs := make([]iptRule, len(rules))
		for i, r := range rules {
			rs[i] = iptRule{dst: r.Dst, proto: r.Proto, dport: r.DPort, hasDport: r.HasDPort, jump: r.Jump, comment: r.Comment, cond: r.Cond}
		}
		n = len(rs)
		if slices.Equal(rs, p.rules[k]) {
			break
		}
		if len(rs) == 0 {
			delete(p.rules, k)
		} else {
			p.rules[k] = rs
		}
		t.dispatchDirty = true
	}
	p.kept += n - old
	if p.kept > MaxRules {
		return fmt.Errorf("more than %d kube-proxy rules: not one node's table", MaxRules)
	}
	return nil
}

// DeleteChain removes chain name.
func (t *NAT) DeleteChain(name string) {
	if _, ok := keyOf([]byte(name)); !ok || chainKind(name) == chainOther {
		return
	}
	_ = t.SetChain(name, nil) // an empty chain is a deleted one; nothing to refuse
}

// putDNAT makes targets the endpoint chain's DNAT targets (none: it has
// no DNAT), reusing freed slots.
func (p *parser) putDNAT(id sepID, targets []netip.AddrPort) {
	if idx, ok := p.lookupDNAT(id); ok {
		p.free = append(p.free, idx)
		if s, ok := p.dnat[id.a]; ok && s.b == id.b {
			delete(p.dnat, id.a)
		} else {
			delete(p.collide, id)
		}
		delete(p.moreDNAT, id)
	}
	if len(targets) == 0 {
		return
	}
	if p.dnat == nil {
		p.dnat = map[uint64]sepSlot{}
	}
	var idx int32
	if n := len(p.free); n > 0 {
		idx, p.free = p.free[n-1], p.free[:n-1]
		p.targets[idx] = targets[0]
	} else {
		idx = int32(len(p.targets))
		p.targets = append(p.targets, targets[0])
	}
	if _, taken := p.dnat[id.a]; !taken {
		p.dnat[id.a] = sepSlot{id.b, idx}
	} else {
		if p.collide == nil {
			p.collide = map[sepID]int32{}
		}
		p.collide[id] = idx
	}
	if len(targets) > 1 {
		if p.moreDNAT == nil {
			p.moreDNAT = map[sepID][]netip.AddrPort{}
		}
		p.moreDNAT[id] = slices.Clone(targets[1:])
	}
}

// Chains calls f with the name of every chain that holds rules the audit
// keeps.
func (t *NAT) Chains(f func(name string)) {
	p := t.p
	for a, s := range p.dnat {
		f(p.sepName(sepID{a: a, b: s.b}))
	}
	for id := range p.collide {
		f(p.sepName(id))
	}
	for k := range p.policy {
		f(k.String())
	}
	for k := range p.rules {
		f(k.String())
	}
}

// Len is the number of frontends as of the last Changes (0 for a nil
// table).
func (t *NAT) Len() int {
	if t == nil {
		return 0
	}
	return len(t.fronts)
}

// Observed is the whole model of the table.
func (t *NAT) Observed() *audit.Observed {
	t.p.omitChains = t.OmitEndpointChains
	return t.p.observed(t.fam, t.p.frontTable(t.fam))
}

// Changes returns the frontends that changed since the last call (all of
// them at the first), sorted by key, and the keys of those that are gone.
// A chain set to what it held changes nothing.
// A frontend changed when its dispatch rule now goes elsewhere or carries
// another name, when its policy chain changed, or when one of the
// endpoint chains that chain jumps to did.
func (t *NAT) Changes() (changed []audit.ObservedFrontend, removed []audit.FrontendKey) {
	p := t.p
	p.omitChains = t.OmitEndpointChains
	first := t.fronts == nil
	dirty := map[audit.FrontendKey]bool{}
	if first || t.dispatchDirty {
		next := p.frontTable(t.fam)
		for k, f := range t.fronts {
			if g, ok := next[k]; !ok {
				removed = append(removed, k)
			} else if g != f {
				dirty[k] = true
			}
		}
		for k := range next {
			if _, ok := t.fronts[k]; !ok {
				dirty[k] = true
			}
		}
		t.fronts = next
	}
	// audit.Policy chains one of whose endpoint chains changed changed too.
	if len(t.dirtySEP) > 0 && !first {
		seen := map[string]bool{}
		for _, f := range t.fronts {
			if seen[f.policy] || t.dirtyPolicy[f.policy] {
				continue
			}
			seen[f.policy] = true
			for _, id := range p.policy[keyString(f.policy)] {
				if t.dirtySEP[id] {
					t.dirtyPolicy[f.policy] = true
					break
				}
			}
		}
	}
	changed = p.frontends(t.fronts, func(k audit.FrontendKey, f front) bool {
		return first || dirty[k] || t.dirtyPolicy[f.policy]
	})
	slices.SortFunc(removed, audit.FrontendKey.Compare)
	t.dispatchDirty = false
	clear(t.dirtyPolicy)
	clear(t.dirtySEP)
	return changed, removed
}
