//go:build linux

package iptables

import (
	"errors"
	"fmt"
	"hash/maphash"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The legacy tables of genuine captures, as IPT_SO_GET_ENTRIES returns
// them, are in testdata/iptlegacy with what the decoder reads of each
// chain (golden); -update-netlink recaptures them (root).
var legacyCaptures = []struct{ file, capture string }{
	{"clean-ipt-a", "audit/testdata/capture/clean/ipt-a.rules"},
	{"drift-ds-legacy", "audit/testdata/dualstack/drift/ds-legacy.rules"},
}

func decodeLegacyAll(table []byte, fam int) string {
	var b strings.Builder
	err := decodeLegacy(table, layouts[fam], fam, maphash.MakeSeed(), func(string, uint64, int) bool { return false }, func(chain string, rules []Rule) error {
		fmt.Fprintf(&b, "%s\n", chain)
		for _, r := range rules {
			fmt.Fprintf(&b, "  %s\n", describeRule(r))
		}
		return nil
	})
	if err != nil {
		fmt.Fprintf(&b, "error: %v\n", err)
	}
	return b.String()
}

func TestLegacyDecodeCapturedTables(t *testing.T) {
	for _, c := range legacyCaptures {
		for _, fam := range []int{4, 6} {
			base := filepath.Join("testdata", "iptlegacy", fmt.Sprintf("%s.ipv%d", c.file, fam))
			table, err := os.ReadFile(base + ".table")
			if err != nil {
				t.Fatal(err)
			}
			got := decodeLegacyAll(table, fam)
			if *updateGolden {
				if err := os.WriteFile(base+".golden", []byte(got), 0o644); err != nil {
					t.Fatal(err)
				}
				continue
			}
			want, err := os.ReadFile(base + ".golden")
			if err != nil {
				t.Fatal(err)
			}
			if got != string(want) {
				t.Errorf("%s: decoded rules differ from the golden file (go test -run %s -update-golden, and review the diff)", base, t.Name())
			}
			if strings.Contains(got, "error:") || ((fam == 4 || strings.Contains(c.capture, "/ds-")) && !strings.Contains(got, "KUBE-SERVICES")) {
				t.Errorf("%s: %s", base, got)
			}
		}
	}
}

// Malformed tables never panic and decoding allocates in proportion to the
// input; a table cut short is an error, not a model.
func FuzzLegacyDecode(f *testing.F) {
	for _, c := range legacyCaptures {
		for _, fam := range []string{"ipv4", "ipv6"} {
			if table, err := os.ReadFile(filepath.Join("testdata", "iptlegacy", c.file+"."+fam+".table")); err == nil && len(table) > 0 {
				f.Add(table, fam == "ipv6")
				f.Add(table[:len(table)/2], fam == "ipv6")
			}
		}
	}
	seed := maphash.MakeSeed()
	f.Fuzz(func(t *testing.T, table []byte, v6 bool) {
		fam := 4
		if v6 {
			fam = 6
		}
		allocs := testing.AllocsPerRun(1, func() {
			decodeLegacy(table, layouts[fam], fam, seed, func(string, uint64, int) bool { return false }, func(string, []Rule) error { return nil })
		})
		if limit := 256 + float64(len(table))/8; allocs > limit {
			t.Fatalf("%d bytes decoded with %.0f allocations (limit %.0f)", len(table), allocs, limit)
		}
	})
}

// A table cut inside an entry is refused.
func TestLegacyDecodeRefusesTruncated(t *testing.T) {
	table, err := os.ReadFile(filepath.Join("testdata", "iptlegacy", "clean-ipt-a.ipv4.table"))
	if err != nil {
		t.Fatal(err)
	}
	cut := table[:len(table)-7]
	err = decodeLegacy(cut, layouts[4], 4, maphash.MakeSeed(), func(string, uint64, int) bool { return false }, func(string, []Rule) error { return nil })
	if err == nil {
		t.Error("a truncated table decoded")
	}
	if errors.Is(err, ErrUndecodable) {
		t.Errorf("a truncated table is malformed, not undecodable: %v", err)
	}
}
