package audit

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"
)

// TestDependentsGroupOnlyEqualExpectations: nodes of one class get the
// same ExpectedFor (node name aside), and two nodes with the same Key for
// a service expect the same of it, on the captured matrix (zones, Local
// policies, hints) and on nodes hosting nothing.
func TestDependentsGroupOnlyEqualExpectations(t *testing.T) {
	st := loadState(t, "clean")
	// Nodes beyond those in the capture: two zoneless nodes without local
	// endpoints must share a class.
	st.Nodes["extra-1"], st.Nodes["extra-2"] = NodeInfo{}, NodeInfo{}
	nodes := []string{"ipt-a", "ipt-b", "nft-a", "nft-b", "extra-1", "extra-2"}
	h := NewHistory(time.Minute)
	h.Update(st, time.Unix(1_800_000_000, 0))
	var d Dependents
	d.Update(h)
	class := func(n string) uint64 { return d.Class(n, st.Nodes[n].Zone) }
	one := func(i int, node string) Expected {
		e := ExpectedFor(&State{Services: st.Services[i : i+1], Nodes: st.Nodes}, node)
		e.Node = ""
		return e
	}
	same, keyed := 0, 0
	for i, a := range nodes {
		for _, b := range nodes[i+1:] {
			ea, eb := ExpectedFor(st, a), ExpectedFor(st, b)
			ea.Node, eb.Node = "", ""
			if class(a) == class(b) {
				same++
				if !reflect.DeepEqual(ea, eb) {
					t.Errorf("%s and %s share a class but expect different rules", a, b)
				}
			}
			for s := range st.Services {
				svc := st.Services[s].Namespace + "/" + st.Services[s].Name
				if d.Key(svc, a, st.Nodes[a].Zone) != d.Key(svc, b, st.Nodes[b].Zone) {
					continue
				}
				keyed++
				if !reflect.DeepEqual(one(s, a), one(s, b)) {
					t.Errorf("%s and %s have one key for %s but expect different rules for it", a, b, svc)
				}
			}
		}
	}
	if class("extra-1") != class("extra-2") {
		t.Error("two nodes with nothing node-specific are in different classes")
	}
	// Every captured node hosts endpoints of the matrix's Local services.
	for _, a := range nodes[:4] {
		if class(a) == class("extra-1") {
			t.Errorf("%s (hosting Local endpoints) shares the class of a node hosting none", a)
		}
	}
	t.Logf("%d node pairs share a class; %d (pair, service) share a key", same, keyed)
}

// A node matches old versions too: a Local service whose endpoint left
// node a still depends on a while that version is kept, though the
// current one expects the same of a and b; once it is pruned, it does not.
func TestDependentsCoverKeptVersions(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	svc := func(onA bool) *State {
		s := Service{Namespace: "ns", Name: "web", ITPLocal: true, Slices: []Slice{{Family: 4}}}
		if onA {
			s.Slices[0].Endpoints = []SliceEndpoint{{NodeName: "a", Ready: true, Serving: true}}
		}
		return &State{Services: []Service{s}, Nodes: map[string]NodeInfo{"a": {}, "b": {}}}
	}
	h := NewHistory(10 * time.Second)
	h.Update(svc(true), t0)
	var d Dependents
	d.Update(h)
	if d.Key("ns/web", "a", "") == d.Key("ns/web", "b", "") || d.Class("a", "") == d.Class("b", "") {
		t.Fatal("a hosts web's endpoint, yet a and b look alike")
	}
	h.Update(svc(false), t0.Add(time.Second))
	d.Update(h)
	if d.Key("ns/web", "a", "") == d.Key("ns/web", "b", "") {
		t.Error("the kept version with a's endpoint no longer counts")
	}
	var differ []string
	d.Differ("a", "", "b", "", func(s string) { differ = append(differ, s) })
	if len(differ) == 0 {
		t.Error("Differ does not name web for a and b")
	}
	h.Update(svc(false), t0.Add(time.Minute)) // the old version pruned
	d.Update(h)
	if d.Key("ns/web", "a", "") != d.Key("ns/web", "b", "") || d.Class("a", "") != d.Class("b", "") {
		t.Error("a and b still differ after the version naming a was pruned")
	}
}

// loadState reads the clean or drift capture's cluster (the conformance
// tests, golden_test.go, read them through testkit/golden).
func loadState(t testing.TB, dir string) *State {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("testdata", "capture", dir, "cluster.json"))
	if err != nil {
		t.Fatal(err)
	}
	st, err := ParseClusterList(data)
	if err != nil {
		t.Fatal(err)
	}
	return st
}
