package nftables

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/testkit/readertest"
)

// decodedTable is a parsed nft JSON table as a netlink reader decodes it.
func decodedTable(t *nftTable) *Table {
	out := &Table{Family: t.family, Dispatches: t.dispatches(), Chains: map[string][][]Statement{}}
	t.serviceIPs(func(k audit.FrontendKey, target string) { out.ServiceIPs = append(out.ServiceIPs, MapEntry{k, target}) })
	t.nodePorts(func(k audit.FrontendKey, target string) { out.NodePorts = append(out.NodePorts, MapEntry{k, target}) })
	t.noEndpoints(func(k audit.FrontendKey) { out.NoEndpoints = append(out.NoEndpoints, k) })
	for name := range t.chains {
		out.Chains[name] = t.rules(name)
	}
	return out
}

// The table kept map by map and chain by chain reads every nftables
// capture as FromTables does, and its first Changes are the whole
// model.
func TestNFTablesKubeEqualsTheReducer(t *testing.T) {
	paths, _ := filepath.Glob("../../audit/testdata/*/*/*nft*.rules")
	if len(paths) < 4 {
		t.Fatalf("only %d nftables captures", len(paths))
	}
	for _, path := range paths {
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		tables, err := parseNFTTables(bytes.NewReader(data))
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		for fam, pt := range tables {
			nt := decodedTable(pt)
			want, err := FromTables(nt)
			if err != nil {
				t.Fatal(err)
			}
			k := KubeOf(nt)
			got, err := k.Observed()
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("%s %s: the kept table reads\n%+v\nwhere the reducer reads\n%+v", path, fam, got, want)
			}
			changed, removed := k.Changes()
			if len(removed) > 0 || !reflect.DeepEqual(changed, want.Frontends) && len(want.Frontends) > 0 {
				t.Errorf("%s %s: the first changes are not the whole model", path, fam)
			}
		}
	}
}

// Random changes of every kind kube-proxy's nftables mode and a person
// make (a service's chain rewritten, its endpoints moved, a DNAT changed
// by hand, map elements added, dropped or pointed elsewhere, an external
// chain redirected, affinity endpoint chains changed, chains deleted, the
// table flushed): after each round the model so far with the round's
// Changes applied is the whole model.
func TestNFTablesKubeChangesMatchTheWholeModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 5))
	const services = 40
	k := NewKube(4)
	svc := func(i int) string { return fmt.Sprintf("service-%08d-ns/s%d/tcp/http", i, i) }
	ext := func(i int) string { return fmt.Sprintf("external-%08d-ns/s%d/tcp/http", i, i) }
	local := func(i int) string { return fmt.Sprintf("local-%08d-ns/s%d/tcp/http", i, i) }
	epc := func(i, j int) string {
		return fmt.Sprintf("endpoint-%08d-ns/s%d/tcp/http__198.18.%d.%d/8080", j, i, i, j)
	}
	addr := func() netip.AddrPort {
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte{198, 18, 128, byte(rng.IntN(250))}), 8080)
	}
	endpoints := func(i int) {
		n := rng.IntN(4)
		if i%5 == 0 {
			// Session affinity: a verdict map to endpoint chains.
			var gotos []string
			for j := range n {
				gotos = append(gotos, epc(i, j))
				k.SetChain(epc(i, j), [][]Statement{{{DNAT: []netip.AddrPort{addr()}}}})
			}
			k.SetChain(svc(i), [][]Statement{{{}, {Gotos: gotos}}})
			return
		}
		var dnat []netip.AddrPort
		for range n {
			dnat = append(dnat, addr())
		}
		k.SetChain(svc(i), [][]Statement{{{}, {DNAT: dnat}}})
	}
	maps := func() {
		var ips, ports []MapEntry
		var none []audit.FrontendKey
		for i := range services {
			key := audit.FrontendKey{IP: netip.AddrFrom4([4]byte{198, 19, 0, byte(i)}), Protocol: "TCP", Port: 80}
			switch rng.IntN(12) {
			case 0:
				continue // an element missing
			case 1:
				none = append(none, key)
				continue
			case 2:
				ips = append(ips, MapEntry{key, svc((i + 1) % services)}) // pointed elsewhere
				continue
			}
			ips = append(ips, MapEntry{key, svc(i)})
			if i%3 == 0 {
				ports = append(ports, MapEntry{audit.NodePortKey(4, "TCP", uint16(30000+i)), ext(i)})
			}
		}
		k.SetMaps(rng.IntN(30) != 0, ips, ports, none)
	}
	external := func(i int) {
		target := svc(i)
		if rng.IntN(3) == 0 {
			target = local(i)
			k.SetChain(local(i), [][]Statement{{{DNAT: []netip.AddrPort{addr()}}}})
		}
		k.SetChain(ext(i), [][]Statement{{{Gotos: []string{"mark-for-masquerade"}, Verdict: true}}, {{Gotos: []string{target}, Verdict: true}}})
	}
	for i := range services {
		endpoints(i)
		if i%3 == 0 {
			external(i)
		}
	}
	maps()
	model := &audit.Observed{Mode: audit.ModeNFTables, Families: []int{4}, NoRules: true, RejectsKnown: true, Rejects: map[audit.FrontendKey]bool{}}
	for round := range 400 {
		if round > 0 {
			for range 1 + rng.IntN(5) {
				i := rng.IntN(services)
				switch rng.IntN(8) {
				case 0, 1:
					endpoints(i)
				case 2: // a DNAT rewritten by hand, or an endpoint chain's
					if i%5 == 0 {
						k.SetChain(epc(i, 0), [][]Statement{{{DNAT: []netip.AddrPort{addr()}}}})
					} else {
						k.SetChain(svc(i), [][]Statement{{{}, {DNAT: []netip.AddrPort{addr()}}}})
					}
				case 3:
					maps()
				case 4:
					external(i - i%3)
				case 5:
					k.DeleteChain(svc(i))
				case 6:
					k.DeleteChain(epc(i-i%5, rng.IntN(3)))
				case 7: // rewritten with what it holds
					k.SetChain(svc(i), k.chains[svc(i)])
				}
			}
		}
		changed, removed := k.Changes()
		model = readertest.Apply(model, changed, removed)
		want, err := k.Observed()
		if err != nil {
			t.Fatal(err)
		}
		// Rejects are not streamed (Changes does not carry them).
		want.Rejects, model.Rejects = nil, nil
		if !reflect.DeepEqual(model.Frontends, want.Frontends) || model.NoRules != want.NoRules {
			t.Fatalf("round %d: the model with its changes applied differs from the whole model:\n%+v\n%+v", round, model.Frontends, want.Frontends)
		}
	}
	if !strings.HasPrefix(svc(1), "service-") {
		t.Fatal(svc(1))
	}
}
