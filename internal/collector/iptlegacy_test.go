//go:build linux

package collector

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/iptables"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
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
	err := decodeLegacy(table, layouts[fam], fam, maphash.MakeSeed(), func(string, uint64, int) bool { return false }, func(chain string, rules []iptables.Rule) error {
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
	if *updateNetlink {
		captureLegacyTables(t)
	}
	for _, c := range legacyCaptures {
		for _, fam := range []int{4, 6} {
			base := filepath.Join("testdata", "iptlegacy", fmt.Sprintf("%s.ipv%d", c.file, fam))
			table, err := os.ReadFile(base + ".table")
			if err != nil {
				t.Fatal(err)
			}
			got := decodeLegacyAll(table, fam)
			if *updateNetlink {
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
				t.Errorf("%s: decoded rules differ from the golden file (go test -run %s -update-netlink, as root, and review the diff)", base, t.Name())
			}
			if strings.Contains(got, "error:") || ((fam == 4 || strings.Contains(c.capture, "/ds-")) && !strings.Contains(got, "KUBE-SERVICES")) {
				t.Errorf("%s: %s", base, got)
			}
		}
	}
}

func captureLegacyTables(t *testing.T) {
	localcluster.NeedRoot(t, false)
	root, err := localcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, c := range legacyCaptures {
		data, err := os.ReadFile(filepath.Join(root, c.capture))
		if err != nil {
			t.Fatal(err)
		}
		ns, err := localcluster.NewScratch(ctx, "legtables")
		if err != nil {
			t.Fatal(err)
		}
		if err := ns.RestoreIPTables(ctx, data, true); err != nil {
			ns.Close()
			t.Fatal(err)
		}
		err = localcluster.InNetNS(ns.NetNS, func() error {
			for _, fam := range []int{4, 6} {
				table, err := legacyTable(fam)
				if err != nil {
					return err
				}
				if err := os.WriteFile(filepath.Join("testdata", "iptlegacy", fmt.Sprintf("%s.ipv%d.table", c.file, fam)), table, 0o644); err != nil {
					return err
				}
			}
			return nil
		})
		ns.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
}

// legacyTable is the nat table's entries as IPT_SO_GET_ENTRIES returns
// them (none when there is no table).
func legacyTable(fam int) ([]byte, error) {
	af, level := unix.AF_INET, unix.SOL_IP
	if fam == 6 {
		af, level = unix.AF_INET6, unix.SOL_IPV6
	}
	fd, err := unix.Socket(af, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	var info iptGetinfo
	copy(info.Name[:], "nat")
	size := uint32(unsafe.Sizeof(info))
	if _, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), iptSoGetInfo, uintptr(unsafe.Pointer(&info)), uintptr(unsafe.Pointer(&size)), 0); errno != 0 {
		if errno == unix.ENOENT {
			return nil, nil
		}
		return nil, errno
	}
	buf := make([]byte, getEntriesHead+int(info.Size))
	copy(buf, "nat")
	putU32(buf[32:], info.Size)
	l := uint32(len(buf))
	if _, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), iptSoGetEntries, uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&l)), 0); errno != 0 {
		return nil, errno
	}
	return buf[getEntriesHead:], nil
}

func putU32(b []byte, v uint32) { *(*uint32)(unsafe.Pointer(&b[0])) = v }

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
			decodeLegacy(table, layouts[fam], fam, seed, func(string, uint64, int) bool { return false }, func(string, []iptables.Rule) error { return nil })
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
	err = decodeLegacy(cut, layouts[4], 4, maphash.MakeSeed(), func(string, uint64, int) bool { return false }, func(string, []iptables.Rule) error { return nil })
	if err == nil {
		t.Error("a truncated table decoded")
	}
	if errors.Is(err, ErrUndecodable) {
		t.Errorf("a truncated table is malformed, not undecodable: %v", err)
	}
}
