package collector

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/iptables"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// iptablesCaptures are the iptables-save dumps captured from genuine
// kube-proxies (nf_tables backend), both families where the node had them.
func iptablesCaptures(t testing.TB, legacy bool) map[string][]byte {
	t.Helper()
	root, err := localcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	globs := []string{"audit/testdata/capture/*/ipt-*.rules", "audit/testdata/dualstack/*/ds-ipt.rules"}
	if legacy {
		globs = []string{"audit/testdata/dualstack/*/ds-legacy.rules"}
	}
	out := map[string][]byte{}
	for _, g := range globs {
		files, _ := filepath.Glob(filepath.Join(root, g))
		for _, f := range files {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			out[filepath.Base(filepath.Dir(f))+"/"+filepath.Base(f)] = data
		}
	}
	if len(out) == 0 {
		t.Fatal("no iptables captures")
	}
	return out
}

// sameModel fails t when got and want are not the same model, naming the
// first frontend that differs.
func sameModel(t testing.TB, what string, got, want *audit.Observed) bool {
	t.Helper()
	if reflect.DeepEqual(got, want) {
		return true
	}
	a, b := stream.FromModel(got).Root(), stream.FromModel(want).Root()
	t.Errorf("%s: netlink read %d frontends (root %x, families %v, no rules %v), iptables-save %d (root %x, families %v, no rules %v)",
		what, len(got.Frontends), a, got.Families, got.NoRules, len(want.Frontends), b, want.Families, want.NoRules)
	for i := range min(len(got.Frontends), len(want.Frontends)) {
		if !reflect.DeepEqual(got.Frontends[i], want.Frontends[i]) {
			t.Logf("first difference:\n netlink       %+v\n iptables-save %+v", got.Frontends[i], want.Frontends[i])
			break
		}
	}
	return false
}

// The netlink reader reads every iptables ruleset captured from genuine
// kube-proxy (both families, comments and the large-cluster layout) as
// iptables-save and the text parser do: each loaded into a real kernel
// and read back both ways.
func TestE2EIPTablesNetlinkAgreesOnCaptures(t *testing.T) {
	localcluster.NeedRoot(t, false)
	ctx := context.Background()
	for name, data := range iptablesCaptures(t, false) {
		ns, err := localcluster.NewScratch(ctx, "iptfix")
		if err != nil {
			t.Fatal(err)
		}
		if err := ns.RestoreIPTables(ctx, data, false); err != nil {
			ns.Close()
			t.Fatalf("%s: %v", name, err)
		}
		host := NewHost()
		var got, want *audit.Observed
		err = localcluster.InNetNS(ns.NetNS, func() error {
			r := host.Reader(Source{Mode: audit.ModeIPTables}).(*iptables.NFTReader)
			var err error
			if got, err = r.Read(ctx); err != nil {
				return err
			}
			if n := fallbacks(r); n > 0 {
				t.Errorf("%s: the netlink read fell back to iptables-save: %v", name, lastFallback(r))
			}
			// Chain by chain, as a large table is read.
			byChain := iptables.NewNFTReader(nil)
			byChain.SetMaxDumpParts(0)
			again, err := byChain.Read(ctx)
			if err != nil {
				return err
			}
			if byChain.Counts().ByChain == 0 {
				t.Errorf("%s: not read chain by chain", name)
			}
			sameModel(t, name+" chain by chain", again, got)
			// A dump stopped after its first parts, the rest chain by
			// chain, as a large table is read.
			parts := iptables.NewNFTReader(nil)
			parts.SetMaxDumpParts(2)
			again, err = parts.Read(ctx)
			if err != nil {
				return err
			}
			sameModel(t, name+" in two parts, then chain by chain", again, got)
			want, err = host.iptablesSave(Source{Mode: audit.ModeIPTables}).Read(ctx)
			return err
		})
		ns.Close()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if sameModel(t, name, got, want) {
			t.Logf("%s: %d frontends, families %v, same model", name, len(got.Frontends), got.Families)
		}
		if len(want.Frontends) == 0 || !strings.Contains(name, "ds-") && len(got.Families) != 2 {
			t.Errorf("%s: %d frontends in families %v", name, len(want.Frontends), want.Families)
		}
	}
}

// The legacy reader reads every capture loaded into the legacy backend as
// iptables-legacy-save and the text parser do.
func TestE2EIPTablesLegacyAgreesOnCaptures(t *testing.T) {
	localcluster.NeedRoot(t, false)
	ctx := context.Background()
	caps := iptablesCaptures(t, true)
	for name, data := range iptablesCaptures(t, false) {
		caps["legacy "+name] = data
	}
	for name, data := range caps {
		ns, err := localcluster.NewScratch(ctx, "iptlegacy")
		if err != nil {
			t.Fatal(err)
		}
		if err := ns.RestoreIPTables(ctx, data, true); err != nil {
			ns.Close()
			t.Fatalf("%s: %v", name, err)
		}
		src := Source{Mode: audit.ModeIPTables, Legacy: true}
		host := NewHost()
		var got, want *audit.Observed
		err = localcluster.InNetNS(ns.NetNS, func() error {
			r := host.Reader(src).(*iptables.LegacyReader)
			var err error
			if got, err = r.Read(ctx); err != nil {
				return err
			}
			if n := fallbacks(r); n > 0 {
				t.Errorf("%s: the getsockopt read fell back to iptables-legacy-save: %v", name, lastFallback(r))
			}
			want, err = host.iptablesSave(src).Read(ctx)
			return err
		})
		ns.Close()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if sameModel(t, name, got, want) {
			t.Logf("%s: %d frontends, families %v, same model", name, len(got.Frontends), got.Families)
		}
		if len(want.Frontends) == 0 {
			t.Errorf("%s: no frontends", name)
		}
	}
}

// A node whose image has no iptables or nft binary is still detected and
// read, in both backends: the collector asks the kernel for everything.
func TestE2ENoIPTablesBinary(t *testing.T) {
	localcluster.NeedRoot(t, false)
	ctx := context.Background()
	bin := collectorBinary(t)
	data := iptablesCaptures(t, false)["clean/ipt-a.rules"]
	for _, legacy := range []bool{false, true} {
		ns, err := localcluster.NewScratch(ctx, "nobin")
		if err != nil {
			t.Fatal(err)
		}
		if err := ns.RestoreIPTables(ctx, data, legacy); err != nil {
			ns.Close()
			t.Fatal(err)
		}
		want, err := iptables.ParseFamily(strings.NewReader(string(natOnlyDump(data))), 4)
		if err != nil {
			ns.Close()
			t.Fatal(err)
		}
		endpoints := 0
		for _, f := range want.Frontends {
			endpoints += len(f.Endpoints)
		}
		cmd := ns.Command(ctx, "env", "PATH="+t.TempDir(), bin, "--once")
		out, err := cmd.Output()
		ns.Close()
		if err != nil {
			t.Fatalf("legacy %v: %v: %s", legacy, err, out)
		}
		var fp struct {
			Mode                 string
			Frontends, Endpoints int
		}
		if err := json.Unmarshal(out, &fp); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		reader := map[bool]string{false: "iptables (nf_tables backend, netlink)", true: "iptables (legacy backend, getsockopt)"}[legacy]
		if fp.Mode != reader || fp.Frontends != len(want.Frontends) || fp.Endpoints != endpoints {
			t.Errorf("legacy %v, no binaries: read %+v, want %s, %d frontends and %d endpoints", legacy, fp, reader, len(want.Frontends), endpoints)
		}
	}
}

// natOnlyDump is a dump's IPv4 nat table.
func natOnlyDump(dump []byte) []byte {
	s := string(dump)
	start := strings.Index(s, "*nat")
	end := strings.Index(s[start:], "COMMIT\n")
	return []byte(s[start : start+end+len("COMMIT\n")])
}
