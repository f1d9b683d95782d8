package collector

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// footprint mirrors what `proxyaudit-collector --once` prints.
type footprint struct {
	Endpoints       int
	SnapshotBytes   int
	ReadSeconds     float64
	SelfCPUSeconds  float64
	SelfMaxRSSBytes int64
	ToolCPUSeconds  float64
}

// BenchmarkCollectorFootprint runs the real collector binary (`--once`)
// in a network namespace holding a ruleset of 10k services × 10 endpoints
// (large-cluster layout; PROXYAUDIT_BENCH_SMALL=1 for 1k × 10), in each
// mode, beside the bare tool on the same table in the same iteration:
// CPU and peak RSS of the collector itself and of the tool it runs, the
// full snapshot it would send, and its wall time over the tool's.
func BenchmarkCollectorFootprint(b *testing.B) {
	if err := localcluster.CanRun(); err != nil {
		b.Skipf("needs root, iptables and nft: %v", err)
	}
	spec, ipt, nftLoad := benchRules(b)
	root, err := localcluster.RepoRoot()
	if err != nil {
		b.Fatal(err)
	}
	bin := filepath.Join(b.TempDir(), "proxyaudit-collector")
	if out, err := localcluster.GoBuild(context.Background(), root, bin, "./cmd/proxyaudit-collector").CombinedOutput(); err != nil {
		b.Fatalf("build: %v\n%s", err, out)
	}
	ctx := context.Background()
	nftBare := []string{"nft", "-j", "list", "table", "ip", "kube-proxy"}
	for _, m := range []struct {
		name, mode string
		args       []string
		load       []string
		data       []byte
		bare       []string
	}{
		{"iptables", "iptables", nil, []string{"iptables-restore"}, ipt, []string{"iptables-save", "-t", "nat"}},
		{"iptables-legacy", "iptables-legacy", nil, []string{"iptables-legacy-restore"}, ipt, []string{"iptables-legacy-save", "-t", "nat"}},
		// The netlink reader (the default) and nft -j, each beside bare nft.
		{"nftables", "nftables", nil, []string{"nft", "-j", "-f", "-"}, nftLoad, nftBare},
		{"nftables-json", "nftables", []string{"--nft-reader", "nft-json"}, []string{"nft", "-j", "-f", "-"}, nftLoad, nftBare},
	} {
		b.Run(m.name, func(b *testing.B) {
			ns, err := localcluster.NewScratch(ctx, "footprint")
			if err != nil {
				b.Fatal(err)
			}
			defer ns.Close()
			load := ns.Command(ctx, m.load...)
			load.Stdin = bytes.NewReader(m.data)
			if out, err := load.CombinedOutput(); err != nil {
				b.Fatalf("load: %v: %s", err, out)
			}
			var sum footprint
			var collectorWall, bareWall time.Duration
			var toolRSS int64
			for b.Loop() {
				// GNU time forks the tool from its own small process, so
				// the tool's peak RSS is its own.
				t0 := time.Now()
				out, err := ns.Command(ctx, append([]string{"/usr/bin/time", "-f", "%M", "-o", "/dev/stderr"}, m.bare...)...).CombinedOutput()
				if err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				lines := strings.Split(strings.TrimSpace(string(out)), "\n")
				kb, err := strconv.ParseInt(lines[len(lines)-1], 10, 64)
				if err != nil {
					b.Fatalf("GNU time output: %v", err)
				}
				toolRSS = max(toolRSS, kb*1024)
				out, err = ns.Command(ctx, append([]string{bin, "--once", "--mode", m.mode, "--kube-proxy-metrics", ""}, m.args...)...).Output()
				if err != nil {
					b.Fatal(err)
				}
				collectorWall, bareWall = collectorWall+time.Since(t1), bareWall+t1.Sub(t0)
				var f footprint
				if err := json.Unmarshal(out, &f); err != nil {
					b.Fatalf("%v: %s", err, out)
				}
				if f.Endpoints != spec.Services*spec.EndpointsPerService {
					b.Fatalf("collector saw %d endpoints, want %d", f.Endpoints, spec.Services*spec.EndpointsPerService)
				}
				sum.SelfCPUSeconds += f.SelfCPUSeconds
				sum.ToolCPUSeconds += f.ToolCPUSeconds
				sum.SelfMaxRSSBytes = max(sum.SelfMaxRSSBytes, f.SelfMaxRSSBytes)
				sum.SnapshotBytes = f.SnapshotBytes
			}
			n := float64(b.N)
			b.ReportMetric(sum.SelfCPUSeconds/n, "self-cpu-s")
			b.ReportMetric(float64(sum.SelfMaxRSSBytes)/(1<<20), "self-maxrss-MB")
			b.ReportMetric(sum.ToolCPUSeconds/n, "tool-cpu-s")
			b.ReportMetric(float64(toolRSS)/(1<<20), "tool-maxrss-MB")
			b.ReportMetric(float64(sum.SnapshotBytes)/(1<<20), "snapshot-MB")
			b.ReportMetric(100*(collectorWall-bareWall).Seconds()/bareWall.Seconds(), "wall-over-tool-%")
		})
	}
}

// benchRules is the benchmarks' ruleset: 10k services × 10 endpoints
// (PROXYAUDIT_BENCH_SMALL=1: 1k × 10, with comments) as iptables-restore
// input and as nft -j -f input.
func benchRules(b *testing.B) (spec synth.Spec, ipt, nftLoad []byte) {
	b.Helper()
	spec = synth.Spec{Services: 10000, EndpointsPerService: 10}
	if os.Getenv("PROXYAUDIT_BENCH_SMALL") != "" {
		spec = synth.Spec{Services: 1000, EndpointsPerService: 10, Comments: true}
	}
	var save, nft bytes.Buffer
	if err := spec.WriteIPTablesSave(&save); err != nil {
		b.Fatal(err)
	}
	if err := spec.WriteNFTJSON(&nft); err != nil {
		b.Fatal(err)
	}
	nftLoad, err := synth.NFTLoadOrder(nft.Bytes())
	if err != nil {
		b.Fatal(err)
	}
	return spec, save.Bytes(), nftLoad
}
