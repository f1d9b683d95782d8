package audit

import (
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"strings"
)

// nftObj is one entry of `nft -j` output; only the kinds the audit reads
// are decoded.
type nftObj struct {
	Table *struct {
		Family string `json:"family"`
		Name   string `json:"name"`
	} `json:"table"`
	Map  *nftSet `json:"map"`
	Set  *nftSet `json:"set"`
	Rule *struct {
		Family string            `json:"family"`
		Table  string            `json:"table"`
		Chain  string            `json:"chain"`
		Expr   []json.RawMessage `json:"expr"`
	} `json:"rule"`
}

type nftSet struct {
	Family string            `json:"family"`
	Name   string            `json:"name"`
	Table  string            `json:"table"`
	Elem   []json.RawMessage `json:"elem"`
}

// nftTable is kube-proxy's table in one family.
type nftTable struct {
	family int
	maps   map[string]*nftSet
	chains map[string][][]json.RawMessage
}

// MaxJSONBytes bounds an nft JSON document.
const MaxJSONBytes = 512 << 20

// ParseNFTables reads `nft -j list table ip kube-proxy` (or `nft -j list
// ruleset`) output into the observed model. Frontends come from the
// service-ips and service-nodeports maps; the service, local and external
// chains are followed to their numgen DNAT maps or per-endpoint chains.
func ParseNFTables(r io.Reader) (*Observed, error) {
	dec := json.NewDecoder(io.LimitReader(r, MaxJSONBytes))
	var doc struct {
		Nftables []nftObj `json:"nftables"`
	}
	if err := dec.Decode(&doc); err != nil {
		return nil, fmt.Errorf("nft JSON: %v (expected the output of \"nft -j list table ip kube-proxy\")", err)
	}
	if doc.Nftables == nil {
		return nil, fmt.Errorf("nft JSON has no \"nftables\" array (expected the output of \"nft -j list table ip kube-proxy\")")
	}
	tables := map[string]*nftTable{}
	get := func(fam, name string) *nftTable {
		if name != "kube-proxy" || (fam != "ip" && fam != "ip6") {
			return nil
		}
		t := tables[fam]
		if t == nil {
			t = &nftTable{family: 4, maps: map[string]*nftSet{}, chains: map[string][][]json.RawMessage{}}
			if fam == "ip6" {
				t.family = 6
			}
			tables[fam] = t
		}
		return t
	}
	for _, o := range doc.Nftables {
		switch {
		case o.Table != nil:
			get(o.Table.Family, o.Table.Name)
		case o.Map != nil:
			if t := get(o.Map.Family, o.Map.Table); t != nil {
				t.maps[o.Map.Name] = o.Map
			}
		case o.Set != nil:
			if t := get(o.Set.Family, o.Set.Table); t != nil {
				t.maps[o.Set.Name] = o.Set
			}
		case o.Rule != nil:
			if t := get(o.Rule.Family, o.Rule.Table); t != nil {
				t.chains[o.Rule.Chain] = append(t.chains[o.Rule.Chain], o.Rule.Expr)
			}
		}
	}
	obs := &Observed{Mode: ModeNFTables, RejectsKnown: true, Rejects: map[FrontendKey]bool{}}
	dispatch := false
	for _, fam := range []string{"ip", "ip6"} {
		t := tables[fam]
		if t == nil {
			continue
		}
		obs.Families = append(obs.Families, t.family)
		if t.dispatches() {
			dispatch = true
		}
		if err := t.frontends(obs); err != nil {
			return nil, err
		}
	}
	obs.NoRules = !dispatch || len(obs.Frontends) == 0
	if obs.NoRules {
		obs.Frontends = nil
	}
	if len(obs.Families) == 0 {
		obs.Families = []int{4}
	}
	obs.normalize()
	return obs, nil
}

// dispatches reports whether the services chain still looks up service-ips:
// without that rule (a flushed table) no service traffic is translated.
func (t *nftTable) dispatches() bool {
	for _, rule := range t.chains["services"] {
		for _, e := range rule {
			if strings.Contains(string(e), `"@service-ips"`) {
				return true
			}
		}
	}
	return false
}

// nftElem is a map element: key and verdict.
type nftElem struct {
	key     []json.RawMessage // concat parts
	target  string            // goto/jump target chain
	verdict string            // drop, reject-chain, …
}

func parseElem(raw json.RawMessage) (nftElem, bool) {
	var pair []json.RawMessage
	if json.Unmarshal(raw, &pair) != nil || len(pair) != 2 {
		return nftElem{}, false
	}
	keyRaw := pair[0]
	// Elements with comments are wrapped: {"elem": {"val": …, "comment": …}}.
	var wrapped struct {
		Elem *struct {
			Val json.RawMessage `json:"val"`
		} `json:"elem"`
	}
	if json.Unmarshal(keyRaw, &wrapped) == nil && wrapped.Elem != nil {
		keyRaw = wrapped.Elem.Val
	}
	var concat struct {
		Concat []json.RawMessage `json:"concat"`
	}
	if json.Unmarshal(keyRaw, &concat) != nil || concat.Concat == nil {
		return nftElem{}, false
	}
	var v struct {
		Goto *struct{ Target string } `json:"goto"`
		Jump *struct{ Target string } `json:"jump"`
	}
	el := nftElem{key: concat.Concat}
	if json.Unmarshal(pair[1], &v) == nil {
		switch {
		case v.Goto != nil:
			el.target = v.Goto.Target
		case v.Jump != nil:
			el.target = v.Jump.Target
		}
	}
	if el.target == "" {
		el.verdict = string(pair[1])
	}
	return el, true
}

func jsonString(raw json.RawMessage) string {
	var s string
	_ = json.Unmarshal(raw, &s)
	return s
}

func jsonPort(raw json.RawMessage) (uint16, bool) {
	var n int
	if json.Unmarshal(raw, &n) != nil || n < 0 || n > 65535 {
		return 0, false
	}
	return uint16(n), true
}

func (t *nftTable) frontends(obs *Observed) error {
	if m := t.maps["service-ips"]; m != nil {
		for _, raw := range m.Elem {
			el, ok := parseElem(raw)
			if !ok || len(el.key) != 3 {
				return fmt.Errorf("nft map service-ips: unexpected element %s", clip(raw))
			}
			ip, err := netip.ParseAddr(jsonString(el.key[0]))
			port, okp := jsonPort(el.key[2])
			if err != nil || !okp {
				return fmt.Errorf("nft map service-ips: bad key %s", clip(raw))
			}
			t.addFrontend(obs, FrontendKey{IP: ip.Unmap(), Protocol: strings.ToUpper(jsonString(el.key[1])), Port: port}, el.target)
		}
	}
	if m := t.maps["service-nodeports"]; m != nil {
		for _, raw := range m.Elem {
			el, ok := parseElem(raw)
			if !ok || len(el.key) != 2 {
				return fmt.Errorf("nft map service-nodeports: unexpected element %s", clip(raw))
			}
			port, okp := jsonPort(el.key[1])
			if !okp {
				return fmt.Errorf("nft map service-nodeports: bad key %s", clip(raw))
			}
			t.addFrontend(obs, FrontendKey{NodePort: true, Protocol: strings.ToUpper(jsonString(el.key[0])), Port: port}, el.target)
		}
	}
	if m := t.maps["no-endpoint-services"]; m != nil {
		for _, raw := range m.Elem {
			if el, ok := parseElem(raw); ok && len(el.key) == 3 {
				if ip, err := netip.ParseAddr(jsonString(el.key[0])); err == nil {
					port, _ := jsonPort(el.key[2])
					obs.Rejects[FrontendKey{IP: ip.Unmap(), Protocol: strings.ToUpper(jsonString(el.key[1])), Port: port}] = true
				}
			}
		}
	}
	return nil
}

func (t *nftTable) addFrontend(obs *Observed, key FrontendKey, target string) {
	scope, policy := t.policy(target, 0)
	if policy == "" {
		return
	}
	f := ObservedFrontend{FrontendKey: key, Scope: scope, Chain: policy, Name: nftChainName(policy)}
	seen := map[netip.AddrPort]bool{}
	addEP := func(a netip.AddrPort, chain string) {
		if a.IsValid() && !seen[a] {
			seen[a] = true
			f.Endpoints = append(f.Endpoints, Endpoint{Addr: a, Weight: -1, Chain: chain})
		}
	}
	for _, rule := range t.chains[policy] {
		for _, e := range rule {
			for _, a := range dnatTargets(e) {
				addEP(a, policy)
			}
			for _, ch := range gotoTargets(e) {
				if !strings.HasPrefix(ch, "endpoint-") {
					continue
				}
				for _, er := range t.chains[ch] {
					for _, ee := range er {
						for _, a := range dnatTargets(ee) {
							addEP(a, ch)
						}
					}
				}
			}
		}
	}
	obs.Frontends = append(obs.Frontends, f)
}

// policy follows an external-… chain to the service-… (cluster) or local-…
// chain its last unconditional goto names.
func (t *nftTable) policy(chain string, depth int) (Scope, string) {
	switch {
	case depth > 3:
		return "", ""
	case strings.HasPrefix(chain, "service-"):
		return ScopeCluster, chain
	case strings.HasPrefix(chain, "local-"):
		return ScopeLocal, chain
	case strings.HasPrefix(chain, "external-"):
		rules := t.chains[chain]
		for i := len(rules) - 1; i >= 0; i-- {
			if len(rules[i]) == 1 {
				if ts := gotoTargets(rules[i][0]); len(ts) == 1 {
					return t.policy(ts[0], depth+1)
				}
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

// dnatTargets finds DNAT destinations in one expression: a plain
// {"dnat": {"addr", "port"}} or a numgen map of [i, {"concat": [ip, port]}].
func dnatTargets(e json.RawMessage) []netip.AddrPort {
	var x struct {
		Dnat *struct {
			Addr json.RawMessage `json:"addr"`
			Port json.RawMessage `json:"port"`
		} `json:"dnat"`
	}
	if json.Unmarshal(e, &x) != nil || x.Dnat == nil {
		return nil
	}
	if ip, err := netip.ParseAddr(jsonString(x.Dnat.Addr)); err == nil {
		p, _ := jsonPort(x.Dnat.Port)
		return []netip.AddrPort{netip.AddrPortFrom(ip.Unmap(), p)}
	}
	var m struct {
		Map struct {
			Data struct {
				Set [][]json.RawMessage `json:"set"`
			} `json:"data"`
		} `json:"map"`
	}
	if json.Unmarshal(x.Dnat.Addr, &m) != nil {
		return nil
	}
	var out []netip.AddrPort
	for _, pair := range m.Map.Data.Set {
		if len(pair) != 2 {
			continue
		}
		var c struct {
			Concat []json.RawMessage `json:"concat"`
		}
		if json.Unmarshal(pair[1], &c) != nil || len(c.Concat) != 2 {
			continue
		}
		ip, err := netip.ParseAddr(jsonString(c.Concat[0]))
		p, ok := jsonPort(c.Concat[1])
		if err == nil && ok {
			out = append(out, netip.AddrPortFrom(ip.Unmap(), p))
		}
	}
	return out
}

// gotoTargets finds chains an expression goes to: a goto/jump verdict or a
// numgen vmap of [i, {"goto": …}].
func gotoTargets(e json.RawMessage) []string {
	var x struct {
		Goto *struct{ Target string } `json:"goto"`
		Jump *struct{ Target string } `json:"jump"`
		Vmap *struct {
			Data struct {
				Set [][]json.RawMessage `json:"set"`
			} `json:"data"`
		} `json:"vmap"`
	}
	if json.Unmarshal(e, &x) != nil {
		return nil
	}
	switch {
	case x.Goto != nil:
		return []string{x.Goto.Target}
	case x.Jump != nil:
		return []string{x.Jump.Target}
	case x.Vmap != nil:
		var out []string
		for _, pair := range x.Vmap.Data.Set {
			if len(pair) == 2 {
				out = append(out, gotoTargets(pair[1])...)
			}
		}
		return out
	}
	return nil
}
