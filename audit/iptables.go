package audit

import (
	"bufio"
	"fmt"
	"io"
	"net/netip"
	"strconv"
	"strings"
)

// MaxLineBytes bounds one line of rule text; longer lines are an error.
const MaxLineBytes = 64 << 10

// iptRule is the part of an iptables rule the audit reads.
type iptRule struct {
	dst      netip.Addr
	proto    string
	dport    uint16
	jump     string
	toDest   netip.AddrPort
	comment  string
	cond     bool // matches on source or address type: not an unconditional jump
	hasDport bool
}

// ParseIPTables reads iptables-save output (nf_tables or legacy backend;
// the nat table, optionally the filter table) into the observed model,
// following jumps from KUBE-SERVICES and KUBE-NODEPORTS. Chains no frontend
// reaches (leftovers of a partial sync) do not count. Comments are used only
// for display names.
func ParseIPTables(r io.Reader) (*Observed, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), MaxLineBytes)
	nat := map[string][]iptRule{}
	var filterSvc []iptRule
	table := ""
	sawNat, sawFilter := false, false
	lineNo := 0
	for sc.Scan() {
		lineNo++
		line := sc.Bytes()
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		switch line[0] {
		case '*':
			table = string(line[1:])
			if table == "nat" {
				sawNat = true
			} else if table == "filter" {
				sawFilter = true
			}
			continue
		case ':':
			if table == "" {
				return nil, fmt.Errorf("line %d: chain declaration outside a table (expected a \"*nat\" line first)", lineNo)
			}
			if table == "nat" {
				name, _, _ := strings.Cut(string(line[1:]), " ")
				if _, ok := nat[name]; !ok {
					nat[name] = nil
				}
			}
			continue
		}
		if string(line) == "COMMIT" {
			table = ""
			continue
		}
		if len(line) < 3 || line[0] != '-' || line[1] != 'A' || line[2] != ' ' {
			return nil, fmt.Errorf("line %d: expected a rule (\"-A CHAIN …\"), a chain (\":CHAIN\"), a table (\"*nat\") or COMMIT in iptables-save output, got %q", lineNo, clip(line))
		}
		if table == "" {
			return nil, fmt.Errorf("line %d: rule outside a table (expected a \"*nat\" line first)", lineNo)
		}
		rest := line[3:]
		sp := indexByte(rest, ' ')
		chain := string(rest)
		if sp >= 0 {
			chain = string(rest[:sp])
		}
		if !strings.HasPrefix(chain, "KUBE-") {
			continue
		}
		wantNat := table == "nat" && (chain == "KUBE-SERVICES" || chain == "KUBE-NODEPORTS" || isServiceChain(chain))
		wantFilter := table == "filter" && (chain == "KUBE-SERVICES" || chain == "KUBE-EXTERNAL-SERVICES")
		if !wantNat && !wantFilter {
			continue
		}
		var args []byte
		if sp >= 0 {
			args = rest[sp+1:]
		}
		rule, err := parseIPTRule(args)
		if err != nil {
			return nil, fmt.Errorf("line %d: %v", lineNo, err)
		}
		if wantNat {
			nat[chain] = append(nat[chain], rule)
		} else {
			filterSvc = append(filterSvc, rule)
		}
	}
	if err := sc.Err(); err != nil {
		if err == bufio.ErrTooLong {
			return nil, fmt.Errorf("line %d: longer than %d bytes: not iptables-save output", lineNo+1, MaxLineBytes)
		}
		return nil, fmt.Errorf("read iptables-save output: %w", err)
	}
	if !sawNat && !sawFilter {
		return nil, fmt.Errorf("no \"*nat\" table in the input: not iptables-save output (run iptables-save -t nat)")
	}
	return resolveIPTables(nat, filterSvc, sawFilter), nil
}

func isServiceChain(c string) bool {
	return strings.HasPrefix(c, "KUBE-SVC-") || strings.HasPrefix(c, "KUBE-SVL-") || strings.HasPrefix(c, "KUBE-EXT-") ||
		strings.HasPrefix(c, "KUBE-FW-") || strings.HasPrefix(c, "KUBE-SEP-")
}

func resolveIPTables(nat map[string][]iptRule, filterSvc []iptRule, sawFilter bool) *Observed {
	o := &Observed{Mode: ModeIPTables}
	fams := map[int]bool{}
	add := func(key FrontendKey, r iptRule) {
		scope, policy := iptPolicy(nat, r.jump, 0)
		if policy == "" {
			return
		}
		f := ObservedFrontend{FrontendKey: key, Scope: scope, Chain: policy, Name: commentName(r.comment)}
		seen := map[netip.AddrPort]bool{}
		for _, pr := range nat[policy] {
			if !strings.HasPrefix(pr.jump, "KUBE-SEP-") {
				continue
			}
			for _, sr := range nat[pr.jump] {
				if sr.jump == "DNAT" && sr.toDest.IsValid() && !seen[sr.toDest] {
					seen[sr.toDest] = true
					f.Endpoints = append(f.Endpoints, Endpoint{Addr: sr.toDest, Weight: -1, Chain: pr.jump})
				}
			}
		}
		o.Frontends = append(o.Frontends, f)
	}
	for _, r := range nat["KUBE-SERVICES"] {
		if r.dst.IsValid() && r.hasDport && r.proto != "" {
			fams[family(r.dst)] = true
			add(FrontendKey{IP: r.dst, Protocol: r.proto, Port: r.dport}, r)
		}
	}
	for _, r := range nat["KUBE-NODEPORTS"] {
		if r.hasDport && r.proto != "" {
			add(FrontendKey{NodePort: true, Protocol: r.proto, Port: r.dport}, r)
		}
	}
	if sawFilter {
		o.RejectsKnown = true
		o.Rejects = map[FrontendKey]bool{}
		for _, r := range filterSvc {
			if r.jump == "REJECT" && r.dst.IsValid() && r.hasDport {
				o.Rejects[FrontendKey{IP: r.dst, Protocol: r.proto, Port: r.dport}] = true
			}
		}
	}
	o.NoRules = len(o.Frontends) == 0
	for f := range fams {
		o.Families = append(o.Families, f)
	}
	if len(o.Families) == 0 {
		o.Families = []int{4}
	}
	o.normalize()
	return o
}

// iptPolicy follows a frontend's jump to the policy chain that picks an
// endpoint: KUBE-SVC (cluster) or KUBE-SVL (local). KUBE-FW filters and then
// jumps to KUBE-EXT; KUBE-EXT short-circuits local and pod traffic to
// KUBE-SVC and ends with an unconditional jump to its policy chain.
func iptPolicy(nat map[string][]iptRule, chain string, depth int) (Scope, string) {
	if depth > 4 {
		return "", ""
	}
	switch {
	case strings.HasPrefix(chain, "KUBE-SVC-"):
		return ScopeCluster, chain
	case strings.HasPrefix(chain, "KUBE-SVL-"):
		return ScopeLocal, chain
	case strings.HasPrefix(chain, "KUBE-FW-"), strings.HasPrefix(chain, "KUBE-EXT-"):
		rules := nat[chain]
		for i := len(rules) - 1; i >= 0; i-- {
			r := rules[i]
			if strings.HasPrefix(r.jump, "KUBE-EXT-") || strings.HasPrefix(r.jump, "KUBE-SVC-") || strings.HasPrefix(r.jump, "KUBE-SVL-") {
				if !r.cond || strings.HasPrefix(chain, "KUBE-FW-") {
					return iptPolicy(nat, r.jump, depth+1)
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
		var tok string
		tok, b = nextToken(b)
		if tok == "" {
			continue
		}
		if tok == "!" {
			negate = true
			continue
		}
		neg := negate
		negate = false
		needArg := func() (string, error) {
			var v string
			v, b = nextToken(b)
			if v == "" {
				return "", fmt.Errorf("option %s without a value", tok)
			}
			return v, nil
		}
		switch tok {
		case "-d", "--destination":
			v, err := needArg()
			if err != nil {
				return r, err
			}
			if neg {
				r.cond = true
				continue
			}
			if p, err := netip.ParsePrefix(v); err == nil {
				if p.Bits() == p.Addr().BitLen() {
					r.dst = p.Addr()
				} else {
					r.cond = true
				}
			} else if a, err := netip.ParseAddr(v); err == nil {
				r.dst = a
			} else {
				return r, fmt.Errorf("bad destination %q", v)
			}
		case "-p", "--protocol":
			v, err := needArg()
			if err != nil {
				return r, err
			}
			r.proto = strings.ToUpper(v)
		case "--dport", "--destination-port":
			v, err := needArg()
			if err != nil {
				return r, err
			}
			n, err := strconv.ParseUint(v, 10, 16)
			if err != nil {
				return r, fmt.Errorf("bad destination port %q", v)
			}
			r.dport, r.hasDport = uint16(n), true
		case "-j", "--jump", "-g", "--goto":
			v, err := needArg()
			if err != nil {
				return r, err
			}
			r.jump = v
		case "--to-destination":
			v, err := needArg()
			if err != nil {
				return r, err
			}
			ap, err := netip.ParseAddrPort(v)
			if err != nil {
				return r, fmt.Errorf("bad DNAT target %q", v)
			}
			r.toDest = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
		case "--comment":
			v, err := needArg()
			if err != nil {
				return r, err
			}
			r.comment = v
		case "-s", "--source", "--src-type":
			if _, err := needArg(); err != nil {
				return r, err
			}
			r.cond = true
		}
	}
	return r, nil
}

// nextToken returns the next space-separated token, unquoting "…" strings.
func nextToken(b []byte) (string, []byte) {
	for len(b) > 0 && b[0] == ' ' {
		b = b[1:]
	}
	if len(b) == 0 {
		return "", b
	}
	if b[0] == '"' {
		var sb strings.Builder
		i := 1
		for ; i < len(b); i++ {
			if b[i] == '\\' && i+1 < len(b) {
				i++
				sb.WriteByte(b[i])
				continue
			}
			if b[i] == '"' {
				i++
				break
			}
			sb.WriteByte(b[i])
		}
		return sb.String(), b[i:]
	}
	i := indexByte(b, ' ')
	if i < 0 {
		return string(b), nil
	}
	return string(b[:i]), b[i:]
}

func indexByte(b []byte, c byte) int {
	for i, x := range b {
		if x == c {
			return i
		}
	}
	return -1
}

func clip(b []byte) string {
	if len(b) > 80 {
		return string(b[:80]) + "…"
	}
	return string(b)
}
