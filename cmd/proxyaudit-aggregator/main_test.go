package main

import (
	"bytes"
	"strings"
	"testing"
)

func TestFlagsAndHelp(t *testing.T) {
	var out bytes.Buffer
	if code := run([]string{"--help"}, &out); code != 0 || !strings.Contains(out.String(), "[POD_IP]") || !strings.Contains(out.String(), "/api/v1/findings") {
		t.Errorf("--help: exit %d\n%s", code, out.String())
	}
	t.Setenv("POD_IP", "")
	t.Setenv("KUBECONFIG", "")
	for name, tc := range map[string]struct {
		args []string
		says string
	}{
		"short grace":        {[]string{"--grace", "10ms"}, "too short"},
		"bad share":          {[]string{"--mass-divergence-share", "1.5"}, "share"},
		"half TLS":           {[]string{"--tls-cert-file", "c.pem"}, "go together"},
		"bad listen":         {[]string{"--stream-listen", "9443"}, "--stream-listen"},
		"no advertise":       {[]string{}, "--advertise-address is required"},
		"no cluster":         {[]string{"--advertise-address", "10.0.0.1"}, "outside a cluster, pass --kubeconfig"},
		"missing kubeconfig": {[]string{"--advertise-address", "10.0.0.1", "--kubeconfig", "/nonexistent"}, "API client"},
	} {
		var errb bytes.Buffer
		if code := run(tc.args, &errb); code != 2 || !strings.Contains(errb.String(), tc.says) {
			t.Errorf("%s: exit %d: %q", name, code, errb.String())
		}
	}
}
