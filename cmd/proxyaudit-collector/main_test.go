package main

import (
	"bytes"
	"strings"
	"testing"
)

func TestFlagsAndHelp(t *testing.T) {
	var out bytes.Buffer
	if code := run([]string{"--help"}, &out, &out); code != 0 || !strings.Contains(out.String(), "[NODE_NAME]") {
		t.Errorf("--help: exit %d\n%s", code, out.String())
	}
	t.Setenv("NODE_NAME", "")
	for name, args := range map[string][]string{
		"no node":       {"--aggregator", "a:1"},
		"no aggregator": {"--node-name", "n"},
		"bad mode":      {"--node-name", "n", "--aggregator", "a:1", "--mode", "userspace"},
		"ipvs not yet":  {"--node-name", "n", "--aggregator", "a:1", "--mode", "ipvs"},
		"short":         {"--node-name", "n", "--aggregator", "a:1", "--interval", "10ms"},
		"no CA":         {"--node-name", "n", "--aggregator", "a:1", "--ca-file", "/nonexistent"},
	} {
		var errb bytes.Buffer
		if code := run(args, &errb, &errb); code != 2 || !strings.Contains(errb.String(), "proxyaudit-collector:") {
			t.Errorf("%s: exit %d: %q", name, code, errb.String())
		}
	}
}
