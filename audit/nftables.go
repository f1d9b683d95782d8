package audit

import (
	"bytes"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"strings"
)

// nftTable is kube-proxy's table in one family: the maps the audit reads
// (their element lists, unparsed) and each chain's rules (their expression
// lists, unparsed, read only for chains a frontend reaches).
type nftTable struct {
	family int
	maps   map[string][]byte
	chains map[string][][]byte
}

// MaxJSONBytes bounds an nft JSON document (100k endpoints take 10 MB).
const MaxJSONBytes = 128 << 20

// nftMaps are the maps and sets the audit reads.
var nftMaps = map[string]bool{"service-ips": true, "service-nodeports": true, "no-endpoint-services": true}

// ParseNFTables reads `nft -j list table ip kube-proxy` (or `nft -j list
// ruleset`) output into the observed model. Frontends come from the
// service-ips and service-nodeports maps; the service, local and external
// chains are followed to their numgen DNAT maps or per-endpoint chains.
func ParseNFTables(r io.Reader) (*Observed, error) {
	tables, err := parseNFTTables(r)
	if err != nil {
		return nil, err
	}
	return reduceNFT(nftSources(tables))
}

// parseNFTTables reads nft's JSON into kube-proxy's table of each family
// ("ip", "ip6").
func parseNFTTables(r io.Reader) (map[string]*nftTable, error) {
	data, err := io.ReadAll(io.LimitReader(r, MaxJSONBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read nft JSON: %w", err)
	}
	if len(data) > MaxJSONBytes {
		return nil, fmt.Errorf("nft JSON is larger than %d MiB: not a kube-proxy table", MaxJSONBytes>>20)
	}
	tables := map[string]*nftTable{}
	get := func(fam, name []byte) *nftTable {
		if string(name) != "kube-proxy" || (string(fam) != "ip" && string(fam) != "ip6") {
			return nil
		}
		t := tables[string(fam)]
		if t == nil {
			t = &nftTable{family: 4, maps: map[string][]byte{}, chains: map[string][][]byte{}}
			if string(fam) == "ip6" {
				t.family = 6
			}
			tables[string(fam)] = t
		}
		return t
	}
	sawArray := false
	sc := &jscan{b: data}
	err = sc.object(func(key []byte) error {
		if string(key) != "nftables" {
			return sc.skip()
		}
		sawArray = true
		return sc.array(func(int) error {
			return sc.object(func(kind []byte) error {
				var fam, table, name, chain, body []byte
				want := string(kind) == "table" || string(kind) == "map" || string(kind) == "set" || string(kind) == "rule"
				if !want {
					return sc.skip()
				}
				err := sc.object(func(field []byte) error {
					var err error
					switch string(field) {
					case "family":
						fam, err = sc.str()
					case "table":
						table, err = sc.str()
					case "name":
						name, err = sc.str()
					case "chain":
						chain, err = sc.str()
					case "elem", "expr":
						body, err = sc.span()
					default:
						err = sc.skip()
					}
					return err
				})
				if err != nil {
					return err
				}
				switch string(kind) {
				case "table":
					get(fam, name)
				case "map", "set":
					if t := get(fam, table); t != nil && nftMaps[string(name)] {
						t.maps[string(name)] = body
					}
				case "rule":
					if t := get(fam, table); t != nil {
						t.chains[string(chain)] = append(t.chains[string(chain)], body)
					}
				}
				return nil
			})
		})
	})
	if err != nil {
		return nil, fmt.Errorf("%v (expected the output of \"nft -j list table ip kube-proxy\")", err)
	}
	if sc.peek() != 0 {
		return nil, sc.errf("unexpected data after the document (expected the output of \"nft -j list table ip kube-proxy\")")
	}
	if !sawArray {
		return nil, fmt.Errorf("nft JSON has no \"nftables\" array (expected the output of \"nft -j list table ip kube-proxy\")")
	}
	return tables, nil
}

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
// dump (NFTTable). reduceNFT turns either into the observed model.
type nftSource interface {
	familyOf() int
	// dispatches reports whether the services chain still looks up
	// service-ips: without that rule (a flushed table) no service
	// traffic is translated.
	dispatches() bool
	serviceIPs(fn func(FrontendKey, string)) error
	nodePorts(fn func(FrontendKey, string)) error
	noEndpoints(fn func(FrontendKey)) error
	// rules is a chain's rules, each as its statements.
	rules(chain string) [][]NFTStatement
}

func reduceNFT(srcs []nftSource) (*Observed, error) {
	obs := &Observed{Mode: ModeNFTables, RejectsKnown: true, Rejects: map[FrontendKey]bool{}}
	for _, t := range srcs {
		obs.Families = append(obs.Families, t.familyOf())
		if !t.dispatches() {
			// This family's table was flushed: its maps may remain,
			// but nothing looks them up.
			continue
		}
		// Frontends that go to one policy chain share its endpoints, read
		// once (see the iptables reader).
		shared := map[string][]Endpoint{}
		add := func(k FrontendKey, target string) { addFrontend(t, obs, k, target, shared) }
		if err := t.serviceIPs(add); err != nil {
			return nil, err
		}
		if err := t.nodePorts(add); err != nil {
			return nil, err
		}
		if err := t.noEndpoints(func(k FrontendKey) { obs.Rejects[k] = true }); err != nil {
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

func (t *nftTable) familyOf() int { return t.family }

func (t *nftTable) rules(chain string) [][]NFTStatement {
	raw := t.chains[chain]
	out := make([][]NFTStatement, len(raw))
	for i, r := range raw {
		out[i] = statements(r)
	}
	return out
}

func (t *nftTable) dispatches() bool {
	for _, rule := range t.chains["services"] {
		if bytes.Contains(rule, []byte(`"@service-ips"`)) {
			return true
		}
	}
	return false
}

// nftElem is a map element: key and verdict.
type nftElem struct {
	key    [][]byte // concat parts, raw JSON values
	target string   // goto/jump target chain
}

// elements reads a map's element list: [key, verdict] pairs whose key is a
// concat, possibly wrapped with a comment as {"elem": {"val": …}}.
func elements(raw []byte, fn func(nftElem) error) error {
	sc := at(raw)
	return sc.array(func(int) error {
		var el nftElem
		if sc.peek() != '[' {
			return sc.skip() // a set element: not a map entry
		}
		err := sc.array(func(i int) error {
			switch i {
			case 0:
				k, err := concat(sc)
				el.key = k
				return err
			case 1:
				t, err := verdictTarget(sc)
				el.target = t
				return err
			}
			return sc.skip()
		})
		if err != nil {
			return err
		}
		return fn(el)
	})
}

// concat reads {"concat": [v, …]} or {"elem": {"val": {"concat": …}}} and
// returns the parts as raw values.
func concat(sc *jscan) ([][]byte, error) {
	var parts [][]byte
	if sc.peek() != '{' {
		return nil, sc.skip()
	}
	err := sc.object(func(k []byte) error {
		switch string(k) {
		case "concat":
			return sc.array(func(int) error {
				v, err := sc.span()
				parts = append(parts, v)
				return err
			})
		case "elem":
			return sc.object(func(k []byte) error {
				if string(k) != "val" {
					return sc.skip()
				}
				p, err := concat(sc)
				parts = p
				return err
			})
		}
		return sc.skip()
	})
	return parts, err
}

// verdictTarget reads {"goto": {"target": …}} or {"jump": …} and returns
// the chain; other verdicts return "".
func verdictTarget(sc *jscan) (string, error) {
	target := ""
	if sc.peek() != '{' {
		return "", sc.skip()
	}
	err := sc.object(func(k []byte) error {
		if string(k) != "goto" && string(k) != "jump" {
			return sc.skip()
		}
		t, err := verdictBody(sc)
		target = t
		return err
	})
	return target, err
}

func jsonString(raw []byte) string {
	v, err := at(raw).str()
	if err != nil {
		return ""
	}
	return string(v)
}

func jsonPort(raw []byte) (uint16, bool) {
	sc := at(raw)
	n, err := sc.int()
	if err != nil || sc.peek() != 0 || n < 0 || n > 65535 {
		return 0, false
	}
	return uint16(n), true
}

func (t *nftTable) serviceIPs(fn func(FrontendKey, string)) error {
	m := t.maps["service-ips"]
	if m == nil {
		return nil
	}
	return elements(m, func(el nftElem) error {
		if len(el.key) != 3 {
			return fmt.Errorf("nft map service-ips: unexpected element key with %d parts", len(el.key))
		}
		ip, err := netip.ParseAddr(jsonString(el.key[0]))
		port, okp := jsonPort(el.key[2])
		if err != nil || !okp {
			return fmt.Errorf("nft map service-ips: bad key %s", clip(bytes.Join(el.key, []byte(", "))))
		}
		fn(FrontendKey{IP: ip.Unmap(), Protocol: strings.ToUpper(jsonString(el.key[1])), Port: port}, el.target)
		return nil
	})
}

func (t *nftTable) nodePorts(fn func(FrontendKey, string)) error {
	m := t.maps["service-nodeports"]
	if m == nil {
		return nil
	}
	return elements(m, func(el nftElem) error {
		if len(el.key) != 2 {
			return fmt.Errorf("nft map service-nodeports: unexpected element key with %d parts", len(el.key))
		}
		port, okp := jsonPort(el.key[1])
		if !okp {
			return fmt.Errorf("nft map service-nodeports: bad key %s", clip(bytes.Join(el.key, []byte(", "))))
		}
		fn(NodePortKey(t.family, strings.ToUpper(jsonString(el.key[0])), port), el.target)
		return nil
	})
}

func (t *nftTable) noEndpoints(fn func(FrontendKey)) error {
	m := t.maps["no-endpoint-services"]
	if m == nil {
		return nil
	}
	return elements(m, func(el nftElem) error {
		if len(el.key) == 3 {
			if ip, err := netip.ParseAddr(jsonString(el.key[0])); err == nil {
				port, _ := jsonPort(el.key[2])
				fn(FrontendKey{IP: ip.Unmap(), Protocol: strings.ToUpper(jsonString(el.key[1])), Port: port})
			}
		}
		return nil
	})
}

// addFrontend follows a map element's target to the frontend's policy
// chain and its endpoints: DNATs in the chain (a numgen map or a plain
// address) and in the endpoint chains it goes to (session affinity).
func addFrontend(t nftSource, obs *Observed, key FrontendKey, target string, shared map[string][]Endpoint) {
	scope, policy := nftPolicy(t, target, 0)
	if policy == "" {
		return
	}
	eps, ok := shared[policy]
	if !ok {
		eps = policyEndpoints(t, policy)
		shared[policy] = eps
	}
	obs.Frontends = append(obs.Frontends, ObservedFrontend{FrontendKey: key, Scope: scope, Chain: policy, Name: nftChainName(policy), Endpoints: eps})
}

// policyEndpoints reads a policy chain's endpoints: its DNATs (a numgen
// map or a plain address) and those of the endpoint chains it goes to
// (session affinity), sorted and without repeats.
func policyEndpoints(t nftSource, policy string) []Endpoint {
	// Counted first, so that 100k endpoints are one allocation, not a
	// slice grown ten times.
	type part struct {
		chain string
		rules [][]NFTStatement
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
	eps := make([]Endpoint, 0, n)
	for _, p := range parts {
		for _, rule := range p.rules {
			for _, st := range rule {
				for _, a := range st.DNAT {
					eps = append(eps, Endpoint{Addr: a, Weight: -1, Chain: p.chain})
				}
			}
		}
	}
	return SortEndpoints(eps)
}

// nftPolicy follows an external-… chain to the service-… (cluster) or
// local-… chain its last unconditional goto names.
func nftPolicy(t nftSource, chain string, depth int) (Scope, string) {
	switch {
	case depth > 3:
		return "", ""
	case strings.HasPrefix(chain, "service-"):
		return ScopeCluster, chain
	case strings.HasPrefix(chain, "local-"):
		return ScopeLocal, chain
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

// NFTStatement is what the audit reads of one rule statement: DNAT
// destinations (a plain address, or the values of a numgen map) and the
// chains it goes to (a goto or jump verdict, Verdict true; or the values
// of a numgen verdict map).
type NFTStatement struct {
	DNAT    []netip.AddrPort
	Gotos   []string
	Verdict bool
}

// statements reads a rule's expression list. Unreadable rules read as
// empty: they route nothing the audit can name.
func statements(rule []byte) []NFTStatement {
	var out []NFTStatement
	sc := at(rule)
	err := sc.array(func(int) error {
		var st NFTStatement
		if sc.peek() != '{' {
			return sc.skip()
		}
		err := sc.object(func(k []byte) error {
			switch string(k) {
			case "dnat":
				return readDNAT(sc, &st)
			case "goto", "jump":
				st.Verdict = true
				t, err := verdictBody(sc)
				if t != "" {
					st.Gotos = append(st.Gotos, t)
				}
				return err
			case "vmap":
				return sc.object(func(k []byte) error {
					if string(k) != "data" || sc.peek() != '{' {
						return sc.skip()
					}
					return mapSet(sc, func(v *jscan) error {
						t, err := verdictTarget(v)
						if t != "" {
							st.Gotos = append(st.Gotos, t)
						}
						return err
					})
				})
			}
			return sc.skip()
		})
		out = append(out, st)
		return err
	})
	if err != nil {
		return nil
	}
	return out
}

// concatAddrPort reads {"concat": ["ip", port]}, a numgen DNAT map's
// value, without allocating; anything else reads as invalid.
func concatAddrPort(sc *jscan) (netip.AddrPort, error) {
	var ap netip.AddrPort
	if sc.peek() != '{' {
		return ap, sc.skip()
	}
	err := sc.object(func(k []byte) error {
		if string(k) != "concat" {
			return sc.skip()
		}
		var ip netip.Addr
		var port int64 = -1
		err := sc.array(func(i int) error {
			switch {
			case i == 0 && sc.peek() == '"':
				v, err := sc.str()
				if a, perr := netip.ParseAddr(string(v)); perr == nil {
					ip = a.Unmap()
				}
				return err
			case i == 1 && sc.peek() != '"' && sc.peek() != '{' && sc.peek() != '[':
				n, err := sc.int()
				port = n
				return err
			}
			port = -2 // more than two parts, or the wrong types
			return sc.skip()
		})
		if ip.IsValid() && port >= 0 && port <= 65535 {
			ap = netip.AddrPortFrom(ip, uint16(port))
		}
		return err
	})
	return ap, err
}

// verdictBody reads the {"target": …} of a goto or jump.
func verdictBody(sc *jscan) (string, error) {
	target := ""
	if sc.peek() != '{' {
		return "", sc.skip()
	}
	err := sc.object(func(k []byte) error {
		if string(k) != "target" {
			return sc.skip()
		}
		t, err := sc.str()
		target = string(t)
		return err
	})
	return target, err
}

// mapSet reads {"set": [[key, value], …]} (an anonymous map) and calls fn
// on each value.
func mapSet(sc *jscan, fn func(*jscan) error) error {
	return sc.object(func(k []byte) error {
		if string(k) != "set" {
			return sc.skip()
		}
		return sc.array(func(int) error {
			if sc.peek() != '[' {
				return sc.skip()
			}
			return sc.array(func(i int) error {
				if i == 1 {
					return fn(sc)
				}
				return sc.skip()
			})
		})
	})
}

func readDNAT(sc *jscan, st *NFTStatement) error {
	var addr netip.Addr
	var port uint16
	err := sc.object(func(k []byte) error {
		switch string(k) {
		case "addr":
			switch sc.peek() {
			case '"':
				v, err := sc.str()
				if err != nil {
					return err
				}
				if a, err := netip.ParseAddr(string(v)); err == nil {
					addr = a.Unmap()
				}
				return nil
			case '{':
				return sc.object(func(k []byte) error {
					if string(k) != "map" {
						return sc.skip()
					}
					return sc.object(func(k []byte) error {
						if string(k) != "data" || sc.peek() != '{' {
							return sc.skip()
						}
						return mapSet(sc, func(v *jscan) error {
							ap, err := concatAddrPort(v)
							if ap.IsValid() {
								st.DNAT = append(st.DNAT, ap)
							}
							return err
						})
					})
				})
			}
		case "port":
			if p, err := sc.int(); err == nil && p >= 0 && p <= 65535 {
				port = uint16(p)
				return nil
			}
		}
		return sc.skip()
	})
	if addr.IsValid() {
		st.DNAT = append(st.DNAT, netip.AddrPortFrom(addr, port))
	}
	return err
}

// clip shortens what an error quotes.
func clip(b []byte) string {
	if len(b) > 80 {
		return string(b[:80]) + "…"
	}
	return string(b)
}
