package main

import (
	"bytes"
	"strings"
	"testing"
)

// `proxyaudit version` and `--version` say the same thing: a plain build is
// (devel), with the Go version it was built with.
func TestVersion(t *testing.T) {
	for _, args := range [][]string{{"version"}, {"--version"}} {
		var out, errb bytes.Buffer
		if code := run(args, &out, &errb); code != exitClean {
			t.Fatalf("%v: exit %d: %s", args, code, errb.String())
		}
		if !strings.HasPrefix(out.String(), "proxyaudit (devel) (") || !strings.Contains(out.String(), "go1.") {
			t.Errorf("%v printed %q", args, out.String())
		}
	}
}
