package collector_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	utilexec "k8s.io/utils/exec"
	fakeexec "k8s.io/utils/exec/testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/cilium"
	"github.com/proxyaudit/proxyaudit/dataplane/ipvs"
	"github.com/proxyaudit/proxyaudit/internal/collector"
	"github.com/proxyaudit/proxyaudit/internal/collector/collectortest"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// fakeHost is a host whose kernel holds what the arguments say: a
// kube-ipvs0 interface, nft's answer to the services-chain query, and the
// chains of each iptables backend (nil: that binary is not installed).
func fakeHost(ipvs bool, nftServices string, nft, legacy map[string]bool) (*collector.Host, *[]string) {
	var ran []string
	h := &collector.Host{
		HasInterface: func(name string) bool { return ipvs && name == "kube-ipvs0" },
		IPTables: func(isLegacy bool) (collector.IPTables, error) {
			chains := nft
			if isLegacy {
				chains = legacy
			}
			if chains == nil {
				return nil, fmt.Errorf("lookup: %w", exec.ErrNotFound)
			}
			return &collectortest.IPTables{Chains: chains}, nil
		},
		Exec: &fakeexec.FakeExec{ExactOrder: true, CommandScript: []fakeexec.FakeCommandAction{
			func(cmd string, args ...string) utilexec.Cmd {
				ran = append(ran, cmd+" "+strings.Join(args, " "))
				return fakeexec.InitFakeCmd(&fakeexec.FakeCmd{OutputScript: []fakeexec.FakeAction{
					func() ([]byte, []byte, error) {
						if nftServices == "" {
							return nil, []byte("Error: No such file or directory"), &fakeexec.FakeExitError{Status: 1}
						}
						return []byte(nftServices), nil, nil
					}}}, cmd, args...)
			}}},
	}
	return h, &ran
}

// Detection tries IPVS, then nftables, then each iptables backend, and
// settles on the first that has kube-proxy's rules.
func TestDetectOrder(t *testing.T) {
	kube := map[string]bool{"nat/KUBE-SERVICES": true}
	none := map[string]bool{}
	nftChain := `{"nftables": [{"chain": {"family": "ip", "table": "kube-proxy", "name": "services"}}]}`
	for _, tc := range []struct {
		name         string
		ipvs         bool
		nft          string
		ipt, legacy  map[string]bool
		want         collector.Source
		wantErr      string
		wantNFTQuery bool
	}{
		// IPVS mode keeps an iptables KUBE-SERVICES chain too: the
		// interface decides first.
		{name: "ipvs", ipvs: true, nft: nftChain, ipt: kube, want: collector.Source{Mode: audit.ModeIPVS}},
		{name: "nftables", nft: nftChain, ipt: kube, want: collector.Source{Mode: audit.ModeNFTables}, wantNFTQuery: true},
		{name: "iptables nf_tables backend first", ipt: kube, legacy: kube, want: collector.Source{Mode: audit.ModeIPTables}, wantNFTQuery: true},
		{name: "iptables legacy", ipt: none, legacy: kube, want: collector.Source{Mode: audit.ModeIPTables, Legacy: true}, wantNFTQuery: true},
		{name: "legacy only installed", legacy: kube, want: collector.Source{Mode: audit.ModeIPTables, Legacy: true}, wantNFTQuery: true},
		{name: "nothing programmed", ipt: none, legacy: none, wantErr: "no kube-proxy rules found", wantNFTQuery: true},
		{name: "no iptables at all", wantErr: "no kube-proxy rules found", wantNFTQuery: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, ran := fakeHost(tc.ipvs, tc.nft, tc.ipt, tc.legacy)
			got, err := h.Detect(context.Background())
			if tc.wantErr != "" {
				if err == nil || !errors.Is(err, collector.ErrNoKubeProxy) || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, %v; want %q", got, err, tc.wantErr)
				}
			} else if err != nil || got != tc.want {
				t.Fatalf("got %v, %v; want %v", got, err, tc.want)
			}
			if queried := len(*ran) == 1 && (*ran)[0] == "nft -j list chain ip kube-proxy services"; queried != tc.wantNFTQuery {
				t.Errorf("nft queries %q", *ran)
			}
		})
	}
	// A backend whose chain check fails is named in the error.
	h, _ := fakeHost(false, "", nil, nil)
	h.IPTables = func(bool) (collector.IPTables, error) {
		return &collectortest.IPTables{Err: errors.New("Permission denied (you must be root)")}, nil
	}
	_, err := h.Detect(context.Background())
	if err == nil || !strings.Contains(err.Error(), "iptables-legacy: Permission denied") {
		t.Errorf("failing chain check: %v", err)
	}
	// Refused by the kernel: say which capability is missing, not "no rules".
	if !errors.Is(err, collector.ErrNoPermission) || errors.Is(err, collector.ErrNoKubeProxy) || !strings.Contains(err.Error(), "CAP_NET_ADMIN") {
		t.Errorf("a refused read must name the missing capability: %v", err)
	}
}

// toolHost runs dump tools whose stdout, stderr and exit run gives by
// command line ("iptables-save -t nat"); a tool for which missing
// returns true is not installed.
func toolHost(run func(argv string) (stdout, stderr string, exit error)) (*collector.Host, *[]string) {
	var ran []string
	action := func(cmd string, args ...string) utilexec.Cmd {
		argv := cmd + " " + strings.Join(args, " ")
		ran = append(ran, argv)
		stdout, stderr, exit := run(argv)
		fc := &fakeexec.FakeCmd{
			StdoutPipeResponse: fakeexec.FakeStdIOPipeResponse{ReadCloser: io.NopCloser(strings.NewReader(stdout))},
			StderrPipeResponse: fakeexec.FakeStdIOPipeResponse{ReadCloser: io.NopCloser(strings.NewReader(stderr))},
			WaitResponse:       exit,
		}
		if errors.Is(exit, utilexec.ErrExecutableNotFound) {
			fc.StartResponse, fc.WaitResponse = exit, nil
		}
		return fakeexec.InitFakeCmd(fc, cmd, args...)
	}
	// The tools are what is under test here, not the kernel readers.
	return &collector.Host{Exec: &fakeexec.FakeExec{CommandScript: []fakeexec.FakeCommandAction{action, action, action, action}}, IPTablesSave: true}, &ran
}

// Every reader reads both IP families, each with its own tool run, and
// merges them.
func TestToolReaders(t *testing.T) {
	spec := synth.Spec{Services: 3, EndpointsPerService: 2, Comments: true}
	var save, nftJSON strings.Builder
	if err := spec.WriteIPTablesSave(&save); err != nil {
		t.Fatal(err)
	}
	if err := spec.WriteNFTJSON(&nftJSON); err != nil {
		t.Fatal(err)
	}
	// A single-stack node: kube-proxy's IPv6 tables hold no service.
	save6 := "# Generated by ip6tables-save v1.8.9 (nf_tables)\n*nat\n:KUBE-SERVICES - [0:0]\nCOMMIT\n"
	nft6 := `{"nftables": [{"table": {"family": "ip6", "name": "kube-proxy", "handle": 2}}]}`
	ctx := context.Background()
	for _, tc := range []struct {
		src         collector.Source
		argv, argv6 string
		dump, dump6 string
	}{
		{collector.Source{Mode: audit.ModeIPTables}, "iptables-save -t nat", "ip6tables-save -t nat", save.String(), save6},
		{collector.Source{Mode: audit.ModeIPTables, Legacy: true}, "iptables-legacy-save -t nat", "ip6tables-legacy-save -t nat", save.String(), save6},
		{collector.Source{Mode: audit.ModeNFTables}, "nft -j list table ip kube-proxy", "nft -j list table ip6 kube-proxy", nftJSON.String(), nft6},
	} {
		t.Run(tc.src.String(), func(t *testing.T) {
			dumps := map[string]string{tc.argv: tc.dump, tc.argv6: tc.dump6}
			h, ran := toolHost(func(argv string) (string, string, error) { return dumps[argv], "", nil })
			h.NFTJSON = true
			r := h.Reader(tc.src)
			got, err := r.Read(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if len(*ran) != 2 || (*ran)[0] != tc.argv || (*ran)[1] != tc.argv6 || r.String() != tc.src.String() {
				t.Errorf("ran %q as %s", *ran, r)
			}
			if len(got.Frontends) != 3 || got.Mode != tc.src.Mode || got.NoRules || !slices.Equal(got.Families, []int{4, 6}) {
				t.Errorf("read %s with %d frontends, families %v, no rules %v", got.Mode, len(got.Frontends), got.Families, got.NoRules)
			}
			// The IPv6 dump holding IPv4 rules: a tool that lies is an
			// error, not a node read twice.
			swapped := map[string]string{tc.argv: tc.dump, tc.argv6: tc.dump}
			h, _ = toolHost(func(argv string) (string, string, error) { return swapped[argv], "", nil })
			h.NFTJSON = true
			if got, err := h.Reader(tc.src).Read(ctx); err == nil {
				t.Errorf("IPv4 rules from the IPv6 tool accepted: families %v", got.Families)
			}
			// The tool failing: its own words, whatever it printed.
			h, _ = toolHost(func(string) (string, string, error) {
				return tc.dump[:len(tc.dump)/2], "can't initialize iptables table `nat': Permission denied", &fakeexec.FakeExitError{Status: 4}
			})
			h.NFTJSON = true
			if _, err := h.Reader(tc.src).Read(ctx); err == nil || !strings.Contains(err.Error(), "Permission denied") || !strings.Contains(err.Error(), tc.argv) {
				t.Errorf("failing tool: %v", err)
			}
			// Output that is not a dump: the parser's complaint.
			h, _ = toolHost(func(string) (string, string, error) { return "garbage\n", "", nil })
			h.NFTJSON = true
			if _, err := h.Reader(tc.src).Read(ctx); err == nil || !strings.Contains(err.Error(), "output:") {
				t.Errorf("garbage output: %v", err)
			}
			// No tool for IPv6 (an image without ip6tables): IPv4 read,
			// and said, so that IPv6 is reported as not audited.
			if tc.src.Mode == audit.ModeIPTables {
				h, _ = toolHost(func(argv string) (string, string, error) {
					if argv == tc.argv6 {
						return "", "", utilexec.ErrExecutableNotFound
					}
					return tc.dump, "", nil
				})
				got, err := h.Reader(tc.src).Read(ctx)
				if err != nil || !slices.Equal(got.Families, []int{4}) || len(got.Warnings) != 1 || !strings.Contains(got.Warnings[0], "IPv6 rules not read") {
					t.Errorf("without ip6tables: %+v, %v", got, err)
				}
			}
		})
	}
	// nftables mode: a table that is gone is a flushed node, not an error
	// (kube-proxy's rules were removed); an iptables backend saying the
	// same is an error.
	h, _ := toolHost(func(string) (string, string, error) {
		return "", "Error: No such file or directory\nlist table ip kube-proxy\n                ^^^^^^^^^^", &fakeexec.FakeExitError{Status: 1}
	})
	h.NFTJSON = true
	got, err := h.Reader(collector.Source{Mode: audit.ModeNFTables}).Read(ctx)
	if err != nil || !got.NoRules || got.Mode != audit.ModeNFTables || !slices.Equal(got.Families, []int{4, 6}) {
		t.Errorf("nft table gone: %+v, %v", got, err)
	}
	// Only the IPv6 table gone (flushed by hand on a dual-stack node):
	// IPv4 read, IPv6 read as empty.
	h, _ = toolHost(func(argv string) (string, string, error) {
		if strings.Contains(argv, "ip6") {
			return "", "Error: No such file or directory", &fakeexec.FakeExitError{Status: 1}
		}
		return nftJSON.String(), "", nil
	})
	h.NFTJSON = true
	got, err = h.Reader(collector.Source{Mode: audit.ModeNFTables}).Read(ctx)
	if err != nil || got.NoRules || len(got.Frontends) != 3 || !slices.Equal(got.Families, []int{4, 6}) {
		t.Errorf("ip6 table gone: %+v, %v", got, err)
	}
	h, _ = toolHost(func(string) (string, string, error) {
		return "", "iptables-save: No such file or directory", &fakeexec.FakeExitError{Status: 1}
	})
	if _, err := h.Reader(collector.Source{Mode: audit.ModeIPTables}).Read(ctx); err == nil {
		t.Error("iptables-save failing read as no rules")
	}
}

// The IPVS reader keeps one handle and reopens it after a failed dump.
func TestIPVSReaderReopensAfterAFailure(t *testing.T) {
	vip := netip.MustParseAddrPort("198.19.0.10:53")
	table := &collectortest.IPVS{Servers: []ipvs.VirtualServer{{Addr: vip, Protocol: "UDP", Scheduler: "rr",
		Real: []ipvs.RealServer{{Addr: netip.MustParseAddrPort("198.18.128.5:53"), Weight: 1}}}}}
	opened := 0
	h := &collector.Host{OpenIPVS: func() (ipvs.Table, error) { opened++; return table, nil }}
	r := h.Reader(collector.Source{Mode: audit.ModeIPVS})
	ctx := context.Background()
	for range 2 {
		got, err := r.Read(ctx)
		if err != nil || len(got.Frontends) != 1 || got.Frontends[0].Endpoints[0].Weight != 1 {
			t.Fatalf("read %+v, %v", got, err)
		}
	}
	table.Err = errors.New("netlink: no buffer space available")
	if _, err := r.Read(ctx); err == nil || table.Closed != 1 {
		t.Fatalf("failed dump: %v, closed %d", err, table.Closed)
	}
	table.Err = nil
	if _, err := r.Read(ctx); err != nil || opened != 2 {
		t.Fatalf("after the failure: %v, opened %d times", err, opened)
	}
	// No IPVS in the kernel: the opener's error, every time.
	h = &collector.Host{OpenIPVS: func() (ipvs.Table, error) { return nil, errors.New("this kernel has no IPVS table") }}
	if _, err := h.Reader(collector.Source{Mode: audit.ModeIPVS}).Read(ctx); err == nil || !strings.Contains(err.Error(), "no IPVS") {
		t.Errorf("no IPVS: %v", err)
	}
}
func TestParseMode(t *testing.T) {
	for _, m := range []string{"auto", "iptables", "iptables-legacy", "nftables", "ipvs"} {
		if _, _, err := collector.ParseMode(m); err != nil {
			t.Errorf("%s: %v", m, err)
		}
	}
	for _, m := range []string{"userspace", "kernelspace"} {
		if _, _, err := collector.ParseMode(m); err == nil {
			t.Errorf("%s accepted", m)
		}
	}
}

// A kube-proxy that programs IPv6 alone (its IPv4 chains absent) is found
// by the IPv6 checks, after every IPv4 one: nftables' ip6 table, then
// ip6tables' backends.
func TestDetectIPv6Alone(t *testing.T) {
	kube := map[string]bool{"nat/KUBE-SERVICES": true}
	for _, tc := range []struct {
		name      string
		nft6      bool
		ipt6      map[string]bool
		want      collector.Source
		wantQuery []string
	}{
		{name: "nftables ip6", nft6: true, want: collector.Source{Mode: audit.ModeNFTables},
			wantQuery: []string{"nft -j list chain ip kube-proxy services", "nft -j list chain ip6 kube-proxy services"}},
		{name: "ip6tables", ipt6: kube, want: collector.Source{Mode: audit.ModeIPTables},
			wantQuery: []string{"nft -j list chain ip kube-proxy services", "nft -j list chain ip6 kube-proxy services"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ran []string
			answer := func(cmd string, args ...string) utilexec.Cmd {
				argv := cmd + " " + strings.Join(args, " ")
				ran = append(ran, argv)
				return fakeexec.InitFakeCmd(&fakeexec.FakeCmd{OutputScript: []fakeexec.FakeAction{
					func() ([]byte, []byte, error) {
						if tc.nft6 && strings.Contains(argv, " ip6 ") {
							return []byte(`{"nftables": [{"chain": {"family": "ip6", "table": "kube-proxy", "name": "services"}}]}`), nil, nil
						}
						return nil, []byte("Error: No such file or directory"), &fakeexec.FakeExitError{Status: 1}
					}}}, cmd, args...)
			}
			h := &collector.Host{
				HasInterface: func(string) bool { return false },
				IPTables:     func(bool) (collector.IPTables, error) { return &collectortest.IPTables{Chains: map[string]bool{}}, nil },
				IP6Tables: func(legacy bool) (collector.IPTables, error) {
					if legacy || tc.ipt6 == nil {
						return nil, fmt.Errorf("lookup: %w", exec.ErrNotFound)
					}
					return &collectortest.IPTables{Chains: tc.ipt6}, nil
				},
				Exec: &fakeexec.FakeExec{ExactOrder: true, CommandScript: []fakeexec.FakeCommandAction{answer, answer}},
			}
			got, err := h.Detect(context.Background())
			if err != nil || got != tc.want {
				t.Fatalf("got %v, %v; want %v", got, err, tc.want)
			}
			if !slices.Equal(ran, tc.wantQuery) {
				t.Errorf("queries %q", ran)
			}
		})
	}
}

// A node migrated to Cilium's kube-proxy replacement keeps kube-proxy's
// chains until someone flushes them. Where Cilium's maps are pinned too,
// kube-proxy's rules are audited only while kube-proxy runs; once nothing
// listens at its metrics address they are leftovers (auditing them would
// report every change as drift) and Cilium's maps are audited, with a
// node warning saying why. Without maps, or without the check, nothing
// changes.
func TestDetectLeftoverKubeProxyRulesOnACiliumNode(t *testing.T) {
	kube := map[string]bool{"nat/KUBE-SERVICES": true}
	bpffs := t.TempDir()
	if err := os.MkdirAll(filepath.Join(bpffs, "tc/globals"), 0o755); err != nil {
		t.Fatal(err)
	}
	pinned := func() {
		if err := os.WriteFile(filepath.Join(bpffs, "tc/globals", cilium.Services4), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name    string
		maps    bool
		answers *bool // nil: no check
		legacy  bool
		want    audit.Mode
		note    string
	}{
		{name: "kube-proxy runs beside Cilium", maps: true, answers: ptr(true), want: audit.ModeIPTables},
		{name: "leftover rules", maps: true, answers: ptr(false), want: audit.ModeCilium, note: "--mode iptables if"},
		{name: "leftover legacy rules", maps: true, answers: ptr(false), legacy: true, want: audit.ModeCilium, note: "--mode iptables-legacy if"},
		{name: "no check", maps: true, want: audit.ModeIPTables},
		{name: "no Cilium maps", answers: ptr(false), want: audit.ModeIPTables},
	} {
		t.Run(tc.name, func(t *testing.T) {
			os.Remove(filepath.Join(bpffs, "tc/globals", cilium.Services4))
			if tc.maps {
				pinned()
			}
			ipt, legacy := kube, map[string]bool{}
			if tc.legacy {
				ipt, legacy = map[string]bool{}, kube
			}
			h, _ := fakeHost(false, "", ipt, legacy)
			h.BPFFS = bpffs
			// The genuine agent's maps (dataplane/cilium/testdata/scenario).
			h.ReadCilium = func(string) ([]cilium.MapDump, error) {
				b, err := os.ReadFile("../../dataplane/cilium/testdata/scenario/maps.json")
				if err != nil {
					return nil, err
				}
				var dumps []cilium.MapDump
				return dumps, json.Unmarshal(b, &dumps)
			}
			asked := 0
			if tc.answers != nil {
				h.KubeProxyAnswers = func(context.Context) bool { asked++; return *tc.answers }
			}
			got, err := h.Detect(context.Background())
			if err != nil || got.Mode != tc.want {
				t.Fatalf("got %v, %v; want %s", got, err, tc.want)
			}
			if tc.note == "" && got.Note != "" || tc.note != "" && !strings.Contains(got.Note, tc.note) {
				t.Errorf("note %q, want one saying %q", got.Note, tc.note)
			}
			if !tc.maps && asked > 0 {
				t.Errorf("kube-proxy asked %d times on a node without Cilium's maps", asked)
			}
			if got.Note != "" {
				obs, err := h.Reader(got).Read(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				if len(obs.Frontends) == 0 {
					t.Error("the agent's maps read as no frontends")
				}
				if !slices.Contains(obs.Warnings, got.Note) {
					t.Errorf("a read of Cilium's maps does not warn %q: %q", got.Note, obs.Warnings)
				}
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }

// Listening: refused means kube-proxy does not run; a listener that never
// answers (a hung kube-proxy: the kernel still accepts) or an address
// that cannot be asked counts as running.
func TestListening(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if !collector.Listening("http://" + ln.Addr().String() + "/metrics")(context.Background()) {
		t.Error("a listener that never accepts counted as not running")
	}
	closed, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := closed.Addr().String()
	closed.Close()
	if collector.Listening("http://" + addr + "/metrics")(context.Background()) {
		t.Error("a refused connection counted as running")
	}
	if !collector.Listening("::not a url")(context.Background()) {
		t.Error("an unusable URL counted as not running")
	}
}
