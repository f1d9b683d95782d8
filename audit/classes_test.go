package audit

import (
	"reflect"
	"testing"
)

// TestNodeClassesGroupOnlyEqualExpectations: nodes of one class get the
// same ExpectedFor (node name aside), on the captured matrix (zones, Local
// policies, hints) and on a cluster where some nodes host Local endpoints.
func TestNodeClassesGroupOnlyEqualExpectations(t *testing.T) {
	st := loadState(t, "clean")
	// Nodes beyond those in the capture: two zoneless nodes without local
	// endpoints must share a class.
	st.Nodes["extra-1"], st.Nodes["extra-2"] = NodeInfo{}, NodeInfo{}
	nodes := []string{"ipt-a", "ipt-b", "nft-a", "nft-b", "extra-1", "extra-2"}
	class := NodeClasses(st)
	same := 0
	for i, a := range nodes {
		for _, b := range nodes[i+1:] {
			ea, eb := ExpectedFor(st, a), ExpectedFor(st, b)
			ea.Node, eb.Node = "", ""
			equal := reflect.DeepEqual(ea, eb)
			if class(a) == class(b) {
				same++
				if !equal {
					t.Errorf("%s and %s share a class but expect different rules", a, b)
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
	t.Logf("%d node pairs share a class", same)
}
