package audit

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// MaxLineBytes bounds one line of rule text; longer lines are an error.
const MaxLineBytes = 64 << 10

// MaxRules bounds the rules a reader keeps from one node (kube-proxy writes
// about two per endpoint: 200k at the 100k-endpoint scalability limit), so
// that hostile or runaway input cannot take unbounded memory.
const MaxRules = 4 << 20

// iptRule is the part of an iptables rule the audit reads, for the few
// chains it parses in full (KUBE-SERVICES, KUBE-NODEPORTS, KUBE-EXT-…,
// KUBE-FW-… and the filter table's REJECTs).
type iptRule struct {
	dst      netip.Addr
	proto    string
	dport    uint16
	jump     string
	comment  string
	cond     bool // matches on source or address type: not an unconditional jump
	hasDport bool
}

// chainKey is a chain name as a map key that costs no allocation; iptables
// limits chain names to 28 bytes.
type chainKey [32]byte

func keyOf(b []byte) (chainKey, bool) {
	var k chainKey
	if len(b) == 0 || len(b) > len(k) {
		return k, false
	}
	copy(k[:], b)
	return k, true
}

func keyString(s string) chainKey {
	k, _ := keyOf([]byte(s))
	return k
}

func (k chainKey) String() string {
	n := bytes.IndexByte(k[:], 0)
	if n < 0 {
		n = len(k)
	}
	return string(k[:n])
}

// sepID names an endpoint chain compactly: kube-proxy's names are
// "KUBE-SEP-" plus 16 base32 characters (80 bits), decoded exactly into a
// and b. Any other name gets a sequence number with b's top bit set.
type sepID struct {
	a uint64
	b uint32
}

const sepOther = 1 << 31

type sepSlot struct {
	b   uint32
	idx int32
}

func (p *iptables) addMoreDNAT(id sepID, ap netip.AddrPort) {
	p.kept++
	if p.moreDNAT == nil {
		p.moreDNAT = map[sepID][]netip.AddrPort{}
	}
	p.moreDNAT[id] = append(p.moreDNAT[id], ap)
}

func (p *iptables) lookupDNAT(id sepID) (int32, bool) {
	if s, ok := p.dnat[id.a]; ok && s.b == id.b {
		return s.idx, true
	}
	i, ok := p.collide[id]
	return i, ok
}

// iptables holds what one pass over iptables-save output keeps: the few
// dispatch chains in full, each service policy chain as its jumps to
// endpoint chains, and each endpoint chain as its DNAT target.
type iptables struct {
	rules  map[chainKey][]iptRule
	policy map[chainKey][]sepID
	// iptables-save prints a chain's rules together, so consecutive jumps
	// of one policy chain collect in cur before one map write.
	curKey chainKey
	cur    []sepID
	// declaredSEPs counts ":KUBE-SEP-…" declarations, which precede the
	// rules, to size dnat once.
	declaredSEPs int
	// dnat maps an endpoint chain to the index of its DNAT target in
	// targets, keyed by the ID's first 64 bits: small slots and a fast hash
	// keep a 100k-entry map cache-friendly. IDs that share those bits with
	// another live in collide.
	dnat    map[uint64]sepSlot
	collide map[sepID]int32
	// walked counts the rules policyOf looked at (tests bound it).
	walked     int
	targets    []netip.AddrPort
	moreDNAT   map[sepID][]netip.AddrPort // a second DNAT in one chain: never kube-proxy's, kept anyway
	free       []int32                    // slots of targets no chain uses (IPTablesNAT.SetChain)
	omitChains bool                       // endpointsOf leaves Endpoint.Chain empty
	otherIDs   map[string]sepID
	otherNames []string
	filterSvc  []iptRule
	kept       int // rules retained, against MaxRules
}

// sepIDOf returns the ID of endpoint chain name (with its "KUBE-SEP-").
func (p *iptables) sepIDOf(name []byte) sepID {
	if id, ok := canonicalSEP(name[len(prefixSEP):]); ok {
		return id
	}
	if id, ok := p.otherIDs[string(name)]; ok {
		return id
	}
	if p.otherIDs == nil {
		p.otherIDs = map[string]sepID{}
	}
	id := sepID{a: uint64(len(p.otherNames)), b: sepOther}
	p.otherIDs[string(name)] = id
	p.otherNames = append(p.otherNames, string(name))
	return id
}

func canonicalSEP(h []byte) (sepID, bool) {
	if len(h) != 16 {
		return sepID{}, false
	}
	var id sepID
	for i, c := range h {
		var v byte
		switch {
		case c >= 'A' && c <= 'Z':
			v = c - 'A'
		case c >= '2' && c <= '7':
			v = c - '2' + 26
		default:
			return sepID{}, false
		}
		if i < 12 {
			id.a = id.a<<5 | uint64(v)
		} else {
			id.b = id.b<<5 | uint32(v)
		}
	}
	return id, true
}

const base32Alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"

func (p *iptables) sepName(id sepID) string {
	if id.b&sepOther != 0 {
		return p.otherNames[id.a]
	}
	var b [25]byte
	copy(b[:], prefixSEP)
	for i := 11; i >= 0; i-- {
		b[9+i] = base32Alphabet[id.a&31]
		id.a >>= 5
	}
	for i := 3; i >= 0; i-- {
		b[21+i] = base32Alphabet[id.b&31]
		id.b >>= 5
	}
	return string(b[:])
}

var (
	prefixSEP  = []byte("KUBE-SEP-")
	prefixSVC  = []byte("KUBE-SVC-")
	prefixSVL  = []byte("KUBE-SVL-")
	jumpSEP    = []byte(" -j KUBE-SEP-")
	toDest     = []byte(" --to-destination ")
	commitLine = []byte("COMMIT")
)

// ParseIPTables reads iptables-save output (nf_tables or legacy backend;
// the nat table, optionally the filter table) into the observed model,
// following jumps from KUBE-SERVICES and KUBE-NODEPORTS. Chains no frontend
// reaches (leftovers of a partial sync) do not count. Comments are used only
// for display names.
//
// The input may hold both families one after the other (iptables-save
// and ip6tables-save concatenated): a table that repeats, or a "#
// Generated by ip6tables-save" line, starts the next family's dump. Each
// dump's family is what its header says or its addresses show; an
// empty dump without a header is IPv4 when it stands alone, else the
// family the other dump is not.
//
// It is one pass over the lines with no allocation for the rules that make
// up the bulk of a large ruleset (endpoint chains and the service chains'
// jumps to them); only the dispatch chains are tokenized.
func ParseIPTables(r io.Reader) (*Observed, error) { return parseIPTables(r, 0) }

// ParseIPTablesFamily reads the output of iptables-save (fam 4) or
// ip6tables-save (fam 6): one family, whatever its addresses.
func ParseIPTablesFamily(r io.Reader, fam int) (*Observed, error) { return parseIPTables(r, fam) }

// iptDump is one family's iptables-save output within the input.
type iptDump struct {
	p                 *iptables
	fam               int // from the header or the caller; 0 unknown
	sawNat, sawFilter bool
	firstLine         int
}

func newIPTDump(fam, line int) *iptDump {
	return &iptDump{p: &iptables{rules: map[chainKey][]iptRule{}, policy: map[chainKey][]sepID{}}, fam: fam, firstLine: line}
}

var (
	genIPv4 = []byte("# Generated by iptables-save")
	genIPv6 = []byte("# Generated by ip6tables-save")
)

func parseIPTables(r io.Reader, fam int) (*Observed, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 256<<10), MaxLineBytes)
	dumps := []*iptDump{newIPTDump(fam, 1)}
	d := dumps[0]
	table := ""
	lineNo := 0
	kept := 0
	next := func(hint int) error {
		if fam != 0 {
			return fmt.Errorf("line %d: a second dump in %s output (one family's tables only)", lineNo, saveTool(fam))
		}
		if len(dumps) == 2 {
			return fmt.Errorf("line %d: a third dump: at most an iptables-save and an ip6tables-save output, one after the other", lineNo)
		}
		d = newIPTDump(hint, lineNo)
		dumps = append(dumps, d)
		return nil
	}
	for sc.Scan() {
		lineNo++
		line := sc.Bytes()
		if len(line) == 0 {
			continue
		}
		if line[0] == '#' {
			hint := 0
			if bytes.HasPrefix(line, genIPv6) {
				hint = 6
			} else if bytes.HasPrefix(line, genIPv4) {
				hint = 4
			}
			// iptables-save heads each table with its tool's name: a
			// change of tool is the next family's dump.
			switch tables := d.sawNat || d.sawFilter; {
			case hint == 0 || table != "":
			case fam != 0 && hint != fam:
				return nil, fmt.Errorf("line %d: %s output where %s output was expected", lineNo, saveTool(hint), saveTool(fam))
			case !tables:
				d.fam = hint
			case d.fam != 0 && hint != d.fam, d.fam == 0 && hint == 6:
				if err := next(hint); err != nil {
					return nil, err
				}
			}
			continue
		}
		p := d.p
		switch line[0] {
		case '*':
			if table != "" {
				return nil, fmt.Errorf("line %d: table %q starts inside table %q (a COMMIT is missing)", lineNo, clip(line[1:]), table)
			}
			table = string(line[1:])
			if (table == "nat" && d.sawNat) || (table == "filter" && d.sawFilter) {
				if err := next(0); err != nil {
					return nil, err
				}
			}
			if table == "nat" {
				d.sawNat = true
			} else if table == "filter" {
				d.sawFilter = true
			}
			continue
		case ':':
			if table == "" {
				return nil, fmt.Errorf("line %d: chain declaration outside a table (expected a \"*nat\" line first)", lineNo)
			}
			if bytes.HasPrefix(line[1:], prefixSEP) {
				p.declaredSEPs++
			}
			continue
		}
		if bytes.Equal(line, commitLine) {
			table = ""
			continue
		}
		if len(line) < 3 || line[0] != '-' || line[1] != 'A' || line[2] != ' ' {
			return nil, fmt.Errorf("line %d: expected a rule (\"-A CHAIN …\"), a chain (\":CHAIN\"), a table (\"*nat\") or COMMIT in iptables-save output, got %q", lineNo, clip(line))
		}
		if table == "" {
			return nil, fmt.Errorf("line %d: rule outside a table (expected a \"*nat\" line first)", lineNo)
		}
		before := p.kept
		if err := p.rule(table, line[3:]); err != nil {
			return nil, fmt.Errorf("line %d: %v", lineNo, err)
		}
		if kept += p.kept - before; kept > MaxRules {
			return nil, fmt.Errorf("line %d: more than %d kube-proxy rules: not one node's table", lineNo, MaxRules)
		}
	}
	if err := sc.Err(); err != nil {
		if err == bufio.ErrTooLong {
			return nil, fmt.Errorf("line %d: longer than %d bytes: not iptables-save output", lineNo+1, MaxLineBytes)
		}
		return nil, fmt.Errorf("read iptables-save output: %w", err)
	}
	if table != "" {
		return nil, fmt.Errorf("line %d: the input ends inside table %q without COMMIT: truncated iptables-save output", lineNo, table)
	}
	for _, d := range dumps {
		if !d.sawNat && !d.sawFilter {
			return nil, fmt.Errorf("no \"*nat\" table in the input: not iptables-save output (run iptables-save -t nat)")
		}
	}
	// Each dump's family: its header, else its addresses.
	for _, d := range dumps {
		switch seen := d.p.families(); {
		case len(seen) == 2:
			return nil, fmt.Errorf("line %d: one dump holds IPv4 and IPv6 addresses: not one iptables-save or ip6tables-save output", d.firstLine)
		case len(seen) == 1 && d.fam == 0:
			d.fam = seen[0]
		case len(seen) == 1 && seen[0] != d.fam:
			return nil, fmt.Errorf("line %d: %s output holds IPv%d addresses", d.firstLine, saveTool(d.fam), seen[0])
		}
	}
	switch {
	case len(dumps) == 1 && dumps[0].fam == 0:
		dumps[0].fam = 4
	case len(dumps) == 2 && dumps[0].fam == 0 && dumps[1].fam == 0:
		return nil, fmt.Errorf("two dumps without addresses or \"# Generated by\" headers: cannot tell which is IPv4 and which IPv6 (give each family's dump on its own)")
	case len(dumps) == 2 && dumps[0].fam == 0:
		dumps[0].fam = 10 - dumps[1].fam
	case len(dumps) == 2 && dumps[1].fam == 0:
		dumps[1].fam = 10 - dumps[0].fam
	}
	if len(dumps) == 2 && dumps[0].fam == dumps[1].fam {
		return nil, fmt.Errorf("line %d: two IPv%d dumps: at most one per family", dumps[1].firstLine, dumps[0].fam)
	}
	parts := make([]*Observed, len(dumps))
	for i, d := range dumps {
		parts[i] = d.p.resolve(d.sawFilter, d.fam)
	}
	if len(parts) == 1 {
		return parts[0], nil
	}
	return Merge(parts...)
}

func saveTool(fam int) string {
	if fam == 6 {
		return "ip6tables-save"
	}
	return "iptables-save"
}

// rule takes one rule (the text after "-A ").
func (p *iptables) rule(table string, rest []byte) error {
	if !bytes.HasPrefix(rest, []byte("KUBE-")) {
		return nil
	}
	sp := bytes.IndexByte(rest, ' ')
	if sp < 0 {
		return nil // a rule with no options does nothing the audit reads
	}
	name, args := rest[:sp], rest[sp:]
	if table == "nat" {
		switch {
		case bytes.HasPrefix(name, prefixSEP):
			i := bytes.Index(args, toDest)
			if i < 0 {
				return nil // the masquerade rule
			}
			v := args[i+len(toDest):]
			if j := bytes.IndexByte(v, ' '); j >= 0 {
				v = v[:j]
			}
			ap, ok := parseIPv4Port(v)
			if !ok {
				var err error
				if ap, err = netip.ParseAddrPort(string(v)); err != nil {
					return fmt.Errorf("bad DNAT target %q", clip(v))
				}
				ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
			}
			if p.dnat == nil {
				p.dnat = make(map[uint64]sepSlot, p.declaredSEPs)
				p.targets = make([]netip.AddrPort, 0, p.declaredSEPs)
			}
			id := p.sepIDOf(name)
			idx := int32(len(p.targets))
			switch slot, taken := p.dnat[id.a]; {
			case !taken:
				p.dnat[id.a] = sepSlot{id.b, idx}
			case slot.b == id.b:
				p.addMoreDNAT(id, ap)
				return nil
			default:
				if _, dup := p.collide[id]; dup {
					p.addMoreDNAT(id, ap)
					return nil
				}
				if p.collide == nil {
					p.collide = map[sepID]int32{}
				}
				p.collide[id] = idx
			}
			p.targets = append(p.targets, ap)
			p.kept++
			return nil
		case bytes.HasPrefix(name, prefixSVC), bytes.HasPrefix(name, prefixSVL):
			// The jump is the last option: check the tail before searching.
			var target []byte
			if i := bytes.LastIndexByte(args, ' '); i >= 4 && bytes.HasSuffix(args[:i], []byte(" -j")) {
				target = args[i+1:]
			} else if i := bytes.LastIndex(args, jumpSEP); i >= 0 {
				target = args[i+4:]
				if j := bytes.IndexByte(target, ' '); j >= 0 {
					target = target[:j]
				}
			}
			if !bytes.HasPrefix(target, prefixSEP) {
				return nil // the masquerade rule
			}
			k, ok := keyOf(name)
			if !ok {
				return fmt.Errorf("chain name %q is longer than iptables allows", clip(name))
			}
			tk := p.sepIDOf(target)
			if k != p.curKey {
				p.flushPolicy()
				p.curKey, p.cur = k, p.policy[k]
			}
			p.cur = append(p.cur, tk)
			p.kept++
			return nil
		}
	}
	wantNat := table == "nat" && (string(name) == "KUBE-SERVICES" || string(name) == "KUBE-NODEPORTS" ||
		bytes.HasPrefix(name, []byte("KUBE-EXT-")) || bytes.HasPrefix(name, []byte("KUBE-FW-")))
	wantFilter := table == "filter" && (string(name) == "KUBE-SERVICES" || string(name) == "KUBE-EXTERNAL-SERVICES")
	if !wantNat && !wantFilter {
		return nil
	}
	r, err := parseIPTRule(args)
	if err != nil {
		return err
	}
	p.kept++
	if wantFilter {
		p.filterSvc = append(p.filterSvc, r)
		return nil
	}
	k, _ := keyOf(name)
	p.rules[k] = append(p.rules[k], r)
	return nil
}

func (p *iptables) flushPolicy() {
	if len(p.cur) > 0 {
		p.policy[p.curKey] = p.cur
	}
	p.curKey, p.cur = chainKey{}, nil
}

// families lists the IP families of the dump's service and DNAT
// addresses, ascending.
func (p *iptables) families() []int {
	var seen [7]bool
	for _, r := range p.rules[keyString("KUBE-SERVICES")] {
		if r.dst.IsValid() {
			seen[family(r.dst)] = true
		}
	}
	for _, t := range p.targets {
		seen[family(t.Addr())] = true
	}
	return familyList(seen)
}

// resolve builds the observed model of one family's dump.
func (p *iptables) resolve(sawFilter bool, fam int) *Observed {
	p.flushPolicy()
	o := p.observed(fam, p.frontTable(fam))
	if sawFilter {
		o.RejectsKnown = true
		o.Rejects = map[FrontendKey]bool{}
		for _, r := range p.filterSvc {
			if r.jump == "REJECT" && r.dst.IsValid() && r.hasDport {
				o.Rejects[FrontendKey{IP: r.dst, Protocol: r.proto, Port: r.dport}] = true
			}
		}
	}
	return o
}

// front is where a frontend's dispatch rule sends it: the policy chain
// that picks an endpoint (KUBE-SVC-… or KUBE-SVL-…), its scope, and the
// service's name from the rule's comment.
type front struct {
	scope  Scope
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
func (p *iptables) frontTable(fam int) map[FrontendKey]front {
	svc, np := p.rules[keyServices], p.rules[keyNodePorts]
	out := make(map[FrontendKey]front, len(svc)+len(np))
	// Each chain is followed once, however many frontends jump to it: a
	// dump whose external chain is long and shared would otherwise cost
	// frontends × its length.
	type reached struct {
		scope  Scope
		policy string
	}
	memo := map[string]reached{}
	add := func(key FrontendKey, r iptRule) {
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
			add(FrontendKey{IP: r.dst, Protocol: r.proto, Port: r.dport}, r)
		}
	}
	for _, r := range np {
		if r.hasDport && r.proto != "" {
			add(NodePortKey(fam, r.proto, r.dport), r)
		}
	}
	return out
}

// endpointsOf is what a policy chain's jumps reach: each endpoint chain's
// DNAT targets, sorted. An endpoint chain without DNAT routes nothing.
func (p *iptables) endpointsOf(policy string) []Endpoint {
	seps := p.policy[keyString(policy)]
	eps := make([]Endpoint, 0, len(seps))
	for _, sep := range seps {
		ti, ok := p.lookupDNAT(sep)
		if !ok {
			continue
		}
		name := ""
		if !p.omitChains {
			name = p.sepName(sep)
		}
		eps = append(eps, Endpoint{Addr: p.targets[ti], Weight: -1, Chain: name})
		for _, more := range p.moreDNAT[sep] {
			eps = append(eps, Endpoint{Addr: more, Weight: -1, Chain: name})
		}
	}
	return sortEndpoints(eps)
}

// observed builds the model of the frontends in fronts, sorted by key.
// Frontends that go to one policy chain share its endpoints: read once,
// one slice (kube-proxy points a few frontends at a chain; a dump pointing
// thousands at one costs no more than the dump's size).
func (p *iptables) observed(fam int, fronts map[FrontendKey]front) *Observed {
	o := &Observed{Mode: ModeIPTables, Families: []int{fam}, Frontends: p.frontends(fronts, nil)}
	o.NoRules = len(o.Frontends) == 0
	return o
}

// frontends builds the observed frontends of the keys in fronts that
// want says (all when want is nil), sorted by key.
func (p *iptables) frontends(fronts map[FrontendKey]front, want func(FrontendKey, front) bool) []ObservedFrontend {
	shared := map[string][]Endpoint{}
	var out []ObservedFrontend
	for key, f := range fronts {
		if want != nil && !want(key, f) {
			continue
		}
		eps, ok := shared[f.policy]
		if !ok {
			eps = p.endpointsOf(f.policy)
			shared[f.policy] = eps
		}
		out = append(out, ObservedFrontend{FrontendKey: key, Scope: f.scope, Chain: f.policy, Name: f.name, Endpoints: eps})
	}
	slices.SortFunc(out, func(a, b ObservedFrontend) int { return a.FrontendKey.compare(b.FrontendKey) })
	return out
}

// iptPolicy follows a frontend's jump to the policy chain that picks an
// endpoint: KUBE-SVC (cluster) or KUBE-SVL (local). KUBE-FW filters and then
// jumps to KUBE-EXT; KUBE-EXT short-circuits local and pod traffic to
// KUBE-SVC and ends with an unconditional jump to its policy chain.
func (p *iptables) policyOf(chain string, depth int) (Scope, string) {
	if depth > 4 {
		return "", ""
	}
	switch {
	case strings.HasPrefix(chain, "KUBE-SVC-"):
		return ScopeCluster, chain
	case strings.HasPrefix(chain, "KUBE-SVL-"):
		return ScopeLocal, chain
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

// parseIPTRule reads the options of one rule. It tokenizes by hand (quotes
// only appear around comments) and keeps what the audit needs.
func parseIPTRule(b []byte) (iptRule, error) {
	var r iptRule
	negate := false
	for len(b) > 0 {
		var tok []byte
		tok, b = nextToken(b)
		if len(tok) == 0 {
			continue
		}
		if len(tok) == 1 && tok[0] == '!' {
			negate = true
			continue
		}
		neg := negate
		negate = false
		var v []byte
		switch string(tok) {
		case "-d", "--destination", "-p", "--protocol", "--dport", "--destination-port", "-j", "--jump", "-g", "--goto",
			"--comment", "-s", "--source", "--src-type":
			v, b = nextToken(b)
			if len(v) == 0 {
				return r, fmt.Errorf("option %s without a value", tok)
			}
		default:
			continue
		}
		switch string(tok) {
		case "-d", "--destination":
			if neg {
				r.cond = true
				continue
			}
			if p, err := netip.ParsePrefix(string(v)); err == nil {
				if p.Bits() == p.Addr().BitLen() {
					r.dst = p.Addr()
				} else {
					r.cond = true
				}
			} else if a, err := netip.ParseAddr(string(v)); err == nil {
				r.dst = a
			} else {
				return r, fmt.Errorf("bad destination %q", clip(v))
			}
		case "-p", "--protocol":
			r.proto = protoName(v)
		case "--dport", "--destination-port":
			n, err := strconv.ParseUint(string(v), 10, 16)
			if err != nil {
				return r, fmt.Errorf("bad destination port %q", clip(v))
			}
			r.dport, r.hasDport = uint16(n), true
		case "-j", "--jump", "-g", "--goto":
			r.jump = string(v)
		case "--comment":
			r.comment = unquote(v)
		default: // -s, --source, --src-type
			r.cond = true
		}
	}
	return r, nil
}

func protoName(v []byte) string {
	switch string(v) {
	case "tcp", "TCP":
		return "TCP"
	case "udp", "UDP":
		return "UDP"
	case "sctp", "SCTP":
		return "SCTP"
	}
	return strings.ToUpper(string(v))
}

// nextToken returns the next space-separated token; a "…" token (a comment)
// is returned with its quotes, which unquote removes.
func nextToken(b []byte) ([]byte, []byte) {
	for len(b) > 0 && b[0] == ' ' {
		b = b[1:]
	}
	if len(b) == 0 {
		return nil, b
	}
	if b[0] == '"' {
		for i := 1; i < len(b); i++ {
			switch b[i] {
			case '\\':
				i++
			case '"':
				return b[:i+1], b[i+1:]
			}
		}
		return b, nil
	}
	i := bytes.IndexByte(b, ' ')
	if i < 0 {
		return b, nil
	}
	return b[:i], b[i:]
}

func unquote(v []byte) string {
	if len(v) < 2 || v[0] != '"' {
		return string(v)
	}
	v = v[1:]
	if v[len(v)-1] == '"' {
		v = v[:len(v)-1]
	}
	if bytes.IndexByte(v, '\\') < 0 {
		return string(v)
	}
	var sb strings.Builder
	for i := 0; i < len(v); i++ {
		if v[i] == '\\' && i+1 < len(v) {
			i++
		}
		sb.WriteByte(v[i])
	}
	return sb.String()
}

// parseIPv4Port is a fast path for the common "a.b.c.d:port" DNAT target.
// It accepts only the canonical form (no leading zeros) and leaves anything
// else to netip.ParseAddrPort, so both agree on every input.
func parseIPv4Port(v []byte) (netip.AddrPort, bool) {
	var ip [4]byte
	i := 0
	for k := range 4 {
		start, n := i, 0
		for i < len(v) && v[i] >= '0' && v[i] <= '9' && i-start < 3 {
			n = n*10 + int(v[i]-'0')
			i++
		}
		if i == start || n > 255 || (v[start] == '0' && i-start > 1) {
			return netip.AddrPort{}, false
		}
		ip[k] = byte(n)
		sep := byte('.')
		if k == 3 {
			sep = ':'
		}
		if i >= len(v) || v[i] != sep {
			return netip.AddrPort{}, false
		}
		i++
	}
	start, port := i, 0
	for i < len(v) && v[i] >= '0' && v[i] <= '9' && i-start < 5 {
		port = port*10 + int(v[i]-'0')
		i++
	}
	if i != len(v) || i == start || port > 65535 || (v[start] == '0' && i-start > 1) {
		return netip.AddrPort{}, false
	}
	return netip.AddrPortFrom(netip.AddrFrom4(ip), uint16(port)), true
}

func clip(b []byte) string {
	if len(b) > 80 {
		return string(b[:80]) + "…"
	}
	return string(b)
}
