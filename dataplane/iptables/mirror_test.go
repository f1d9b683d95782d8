//go:build linux

package iptables

import (
	"errors"
	"fmt"
	"slices"
	"testing"
)

func jumps(m *ruleMirror) []string {
	var out []string
	for _, r := range m.rules() {
		out = append(out, r.Jump)
	}
	return out
}

func rule(j string) Rule { return Rule{Jump: j} }

// The mirror places rules as the kernel's notifications say (appended,
// first, after a handle), and applying a batch a second time, as on top
// of a dump that already shows it, changes nothing.
func TestRuleMirrorAppliesNotificationsOnce(t *testing.T) {
	m := mirrorOf([]Rule{rule("a"), rule("b")}, []uint64{1, 2})
	ops := []ruleOp{
		{kind: opNewRule, chain: "KUBE-SERVICES", handle: 3, appended: true, rule: rule("c")},
		{kind: opNewRule, chain: "KUBE-SERVICES", handle: 4, rule: rule("first")},
		{kind: opNewRule, chain: "KUBE-SERVICES", handle: 5, pos: 1, hasPos: true, rule: rule("after-a")},
		// A replace: the same handle deleted and added with new content.
		{kind: opDelRule, chain: "KUBE-SERVICES", handle: 2},
		{kind: opNewRule, chain: "KUBE-SERVICES", handle: 2, pos: 5, hasPos: true, rule: rule("b2")},
		{kind: opDelRule, chain: "KUBE-SERVICES", handle: 3},
		{kind: opDelRule, chain: "KUBE-SERVICES", handle: 99},
	}
	mirrors := map[string]*ruleMirror{"KUBE-SERVICES": m}
	want := []string{"first", "a", "after-a", "b2"}
	for pass := range 2 {
		out := applyOps(mirrors, ops)
		if got := jumps(out["KUBE-SERVICES"]); !slices.Equal(got, want) {
			t.Fatalf("pass %d: %v, want %v", pass, got, want)
		}
	}
	// A rule after one the mirror does not hold: the chain is dumped.
	out := applyOps(mirrors, []ruleOp{{kind: opNewRule, chain: "KUBE-SERVICES", handle: 7, pos: 42, hasPos: true, rule: rule("x")},
		{kind: opNewRule, chain: "KUBE-SERVICES", handle: 8, appended: true, rule: rule("y")}})
	if m, ok := out["KUBE-SERVICES"]; !ok || m != nil {
		t.Errorf("an unplaceable rule did not ask for a dump: %v", out)
	}
	// A rule that did not decode: dumped too.
	out = applyOps(mirrors, []ruleOp{{kind: opNewRule, chain: "KUBE-NODEPORTS", handle: 9, err: errors.New("x")}})
	if m, ok := out["KUBE-NODEPORTS"]; !ok || m != nil {
		t.Errorf("an undecodable rule did not ask for a dump: %v", out)
	}
	// A chain deleted and made again starts empty.
	out = applyOps(mirrors, []ruleOp{{kind: opDelChain, chain: "KUBE-SERVICES"}, {kind: opNewChain, chain: "KUBE-SERVICES"},
		{kind: opNewRule, chain: "KUBE-SERVICES", handle: 20, appended: true, rule: rule("z")}})
	if got := jumps(out["KUBE-SERVICES"]); !slices.Equal(got, []string{"z"}) {
		t.Errorf("a chain made again: %v", got)
	}
	out = applyOps(mirrors, []ruleOp{{kind: opDelChain, chain: "KUBE-SERVICES"}})
	if m := out["KUBE-SERVICES"]; m == nil || len(m.rules()) != 0 {
		t.Errorf("a deleted chain: %v", m)
	}
}

func BenchmarkRuleMirrorSync(b *testing.B) {
	// One kube-proxy sync of KUBE-SERVICES at 10k services: every rule
	// deleted and added again.
	const n = 10000
	rules := make([]Rule, n)
	handles := make([]uint64, n)
	for i := range rules {
		rules[i], handles[i] = rule(fmt.Sprint(i)), uint64(i+1)
	}
	for b.Loop() {
		m := mirrorOf(rules, handles)
		ops := make([]ruleOp, 0, 2*n)
		for i := range n {
			ops = append(ops, ruleOp{kind: opDelRule, chain: "KUBE-SERVICES", handle: uint64(i + 1)})
		}
		for i := range n {
			ops = append(ops, ruleOp{kind: opNewRule, chain: "KUBE-SERVICES", handle: uint64(n + i + 1), appended: true, rule: rules[i]})
		}
		applyOps(map[string]*ruleMirror{"KUBE-SERVICES": m}, ops)["KUBE-SERVICES"].rules()
	}
}
