//go:build linux

package iptables_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/iptables"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

var updateNetlink = flag.Bool("update-netlink", false, "recapture dataplane/iptables/testdata/iptnft from captures loaded into a real kernel (root)")

// The genuine captures whose nat tables' rule messages the iptables-nft
// decoder's tests read (dataplane/iptables/testdata/iptnft), as this
// reader dumps them.
var netlinkCaptures = []struct{ file, capture string }{
	{"clean-ipt-a", "audit/testdata/capture/clean/ipt-a.rules"},
	{"large-ipt-a", "audit/testdata/capture/large/ipt-a.rules"},
	{"drift-ds-ipt", "audit/testdata/dualstack/drift/ds-ipt.rules"},
}

// TestCaptureIPTNFTMessages recaptures them with -update-netlink (root);
// then go test ./dataplane/iptables -update-golden rewrites what the
// decoder reads of them.
func TestCaptureIPTNFTMessages(t *testing.T) {
	if !*updateNetlink {
		t.Skip("-update-netlink recaptures dataplane/iptables/testdata/iptnft")
	}
	captureNetlinkMessages(t)
}

// writeMessages stores messages as a sequence of 4-byte lengths and bodies.
func writeMessages(path string, msgs [][]byte) error {
	var b bytes.Buffer
	for _, m := range msgs {
		b.Write(binary.LittleEndian.AppendUint32(nil, uint32(len(m))))
		b.Write(m)
	}
	return os.WriteFile(path, b.Bytes(), 0o644)
}

func captureNetlinkMessages(t *testing.T) {
	localcluster.NeedRoot(t, false)
	root, err := localcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, c := range netlinkCaptures {
		data, err := os.ReadFile(filepath.Join(root, c.capture))
		if err != nil {
			t.Fatal(err)
		}
		ns, err := localcluster.NewScratch(ctx, "iptmsgs")
		if err != nil {
			t.Fatal(err)
		}
		if err := ns.RestoreIPTables(ctx, data, false); err != nil {
			ns.Close()
			t.Fatal(err)
		}
		err = localcluster.InNetNS(ns.NetNS, func() error {
			for _, fam := range []int{4, 6} {
				var msgs [][]byte
				if err := iptables.DumpNAT(ctx, fam, func(b []byte) error {
					// Every rule of the small captures; the large one's
					// first 300 (its layout repeats).
					if len(msgs) < 300 {
						msgs = append(msgs, bytes.Clone(b))
					}
					return nil
				}); err != nil && !errors.Is(err, unix.ENOENT) {
					return err
				}
				if err := writeMessages(filepath.Join(root, "dataplane", "iptables", "testdata", "iptnft", fmt.Sprintf("%s.ipv%d.msgs", c.file, fam)), msgs); err != nil {
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

// The genuine captures whose legacy nat tables the legacy decoder's tests
// read (dataplane/iptables/testdata/iptlegacy), as IPT_SO_GET_ENTRIES
// returns them.
var legacyCaptures = []struct{ file, capture string }{
	{"clean-ipt-a", "audit/testdata/capture/clean/ipt-a.rules"},
	{"drift-ds-legacy", "audit/testdata/dualstack/drift/ds-legacy.rules"},
}

// TestCaptureLegacyTables recaptures them with -update-netlink (root);
// then go test ./dataplane/iptables -update-golden.
func TestCaptureLegacyTables(t *testing.T) {
	if !*updateNetlink {
		t.Skip("-update-netlink recaptures dataplane/iptables/testdata/iptlegacy")
	}
	captureLegacyTables(t)
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
				if err := os.WriteFile(filepath.Join(root, "dataplane", "iptables", "testdata", "iptlegacy", fmt.Sprintf("%s.ipv%d.table", c.file, fam)), table, 0o644); err != nil {
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
func legacyTable(fam int) ([]byte, error) { return iptables.LegacyNATEntries(fam) }
