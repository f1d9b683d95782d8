// Package nftables is kube-proxy's nftables mode as nft JSON and as the
// tables the collector decodes from the kernel: `nft -j list` output read
// into the audit's model (Parse), decoded tables reduced to it
// (FromTables), and kube-proxy's table kept chain by chain (Kube), with the
// frontends changed since the last look.
package nftables

import (
	"bytes"
	"fmt"
	"io"
	"net/netip"
	"strings"

	"github.com/proxyaudit/proxyaudit/audit"
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
var nftMaps = map[string]bool{"service-ips": true, "service-nodeports": true, "no-endpoint-services": true, "no-endpoint-nodeports": true}

// Parse reads `nft -j list table ip kube-proxy` (or `nft -j list
// ruleset`) output into the observed model. Frontends come from the
// service-ips and service-nodeports maps; the service, local and external
// chains are followed to their numgen DNAT maps or per-endpoint chains.
func Parse(r io.Reader) (*audit.Observed, error) {
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

func (t *nftTable) familyOf() int { return t.family }

func (t *nftTable) rules(chain string) [][]Statement {
	raw := t.chains[chain]
	out := make([][]Statement, len(raw))
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

func (t *nftTable) serviceIPs(fn func(audit.FrontendKey, string)) error {
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
		fn(audit.FrontendKey{IP: ip.Unmap(), Protocol: strings.ToUpper(jsonString(el.key[1])), Port: port}, el.target)
		return nil
	})
}

func (t *nftTable) nodePorts(fn func(audit.FrontendKey, string)) error {
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
		fn(audit.NodePortKey(t.family, strings.ToUpper(jsonString(el.key[0])), port), el.target)
		return nil
	})
}

func (t *nftTable) noEndpoints(fn func(audit.FrontendKey)) error {
	if m := t.maps["no-endpoint-services"]; m != nil {
		if err := elements(m, func(el nftElem) error {
			if len(el.key) == 3 {
				if ip, err := netip.ParseAddr(jsonString(el.key[0])); err == nil {
					port, _ := jsonPort(el.key[2])
					fn(audit.FrontendKey{IP: ip.Unmap(), Protocol: strings.ToUpper(jsonString(el.key[1])), Port: port})
				}
			}
			return nil
		}); err != nil {
			return err
		}
	}
	m := t.maps["no-endpoint-nodeports"]
	if m == nil {
		return nil
	}
	return elements(m, func(el nftElem) error {
		if len(el.key) == 2 {
			if port, ok := jsonPort(el.key[1]); ok {
				fn(audit.NodePortKey(t.family, strings.ToUpper(jsonString(el.key[0])), port))
			}
		}
		return nil
	})
}

// Statement is what the audit reads of one rule statement: DNAT
// destinations (a plain address, or the values of a numgen map) and the
// chains it goes to (a goto or jump verdict, Verdict true; or the values
// of a numgen verdict map).
type Statement struct {
	DNAT    []netip.AddrPort
	Gotos   []string
	Verdict bool
}

// statements reads a rule's expression list. Unreadable rules read as
// empty: they route nothing the audit can name.
func statements(rule []byte) []Statement {
	var out []Statement
	sc := at(rule)
	err := sc.array(func(int) error {
		var st Statement
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

func readDNAT(sc *jscan, st *Statement) error {
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
