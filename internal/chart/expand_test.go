package chart

import "testing"

// The kubelet's $(VAR) expansion, as Localize does it for the chart's
// arguments (the collector's --conntrack-file names its node).
func TestExpand(t *testing.T) {
	env := map[string]string{"NODE_NAME": "node-a", "EMPTY": ""}
	for in, want := range map[string]string{
		"--conntrack-file=/var/lib/proxyaudit/ns.rel.$(NODE_NAME).conntrack.json": "--conntrack-file=/var/lib/proxyaudit/ns.rel.node-a.conntrack.json",
		"$(NODE_NAME)$(NODE_NAME)": "node-anode-a",
		"x$(EMPTY)y":               "xy",
		"$$(NODE_NAME)":            "$(NODE_NAME)",
		"no variables, $ alone":    "no variables, $ alone",
	} {
		if got, err := expand(in, env); err != nil || got != want {
			t.Errorf("expand(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"$(UNDEFINED)", "$(NODE_NAME"} {
		if got, err := expand(bad, env); err == nil {
			t.Errorf("expand(%q) = %q, want an error", bad, got)
		}
	}
}
