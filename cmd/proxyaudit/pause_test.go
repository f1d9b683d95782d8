package main

import (
	"bytes"
	"strings"
	"testing"
)

// What pause refuses before it reaches the API: a pause without a reason
// (the people paged while it lasts must see why), a negative --for, stray
// arguments. Against the API server: internal/e2e/realnodes.
func TestPauseUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		says string
	}{
		{[]string{"pause"}, "--reason is required"},
		{[]string{"pause", "--reason", "  "}, "--reason is required"},
		{[]string{"pause", "--reason", "x", "--for", "-1h"}, "want a positive duration"},
		{[]string{"resume", "now"}, `unexpected argument "now"`},
		{[]string{"pause", "--reason", "x", "--kubeconfig", "/nonexistent"}, "kubeconfig"},
	} {
		var out, errb bytes.Buffer
		if code := run(tc.args, &out, &errb); code != exitUsage || !strings.Contains(errb.String(), tc.says) {
			t.Errorf("%v: exit %d, %q; want %d saying %q", tc.args, code, errb.String(), exitUsage, tc.says)
		}
	}
}
