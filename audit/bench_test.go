package audit_test

// Benchmarks of the rule readers on kube-proxy-layout dumps from
// internal/synth, and side by side in the same run, what the same read costs
// through the tools: iptables-save itself (nf_tables and legacy backends) and
// go-iptables' per-chain listing, on the ruleset loaded into a real kernel.
// docs/benchmarks.md records the results and the commands.

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"testing"
	"time"

	"github.com/coreos/go-iptables/iptables"

	"github.com/proxyaudit/proxyaudit/dataplane"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

var benchSizes = []struct {
	name string
	spec synth.Spec
}{
	// Below 1,000 endpoints kube-proxy writes per-endpoint comments.
	{"1k-endpoints", synth.Spec{Services: 100, EndpointsPerService: 10, Comments: true}},
	{"10k-endpoints", synth.Spec{Services: 1000, EndpointsPerService: 10}},
	// The scalability anchors: 10k services, 100k endpoints.
	{"100k-endpoints", synth.Spec{Services: 10000, EndpointsPerService: 10}},
}

func generate(b *testing.B, spec synth.Spec, nft bool) []byte {
	b.Helper()
	var buf bytes.Buffer
	write := spec.WriteIPTablesSave
	if nft {
		write = spec.WriteNFTJSON
	}
	if err := write(&buf); err != nil {
		b.Fatal(err)
	}
	return buf.Bytes()
}

// BenchmarkParse reads a dump held in memory. Besides MB/s and allocations
// it reports ns per endpoint and heap-MB: the heap right after one parse
// with the collector off (an upper bound of the peak heap).
func BenchmarkParse(b *testing.B) {
	for _, format := range []string{"iptables", "nftables"} {
		for _, size := range benchSizes {
			b.Run(format+"/"+size.name, func(b *testing.B) {
				data := generate(b, size.spec, format == "nftables")
				endpoints := size.spec.Services * size.spec.EndpointsPerService
				b.SetBytes(int64(len(data)))
				heap := peakHeapMB(b, data)
				for b.Loop() {
					if _, err := dataplane.ParseRules(bytes.NewReader(data)); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(endpoints), "ns/endpoint")
				b.ReportMetric(heap, "heap-MB")
			})
		}
	}
}

func peakHeapMB(b *testing.B, data []byte) float64 {
	old := debug.SetGCPercent(-1)
	defer debug.SetGCPercent(old)
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	obs, err := dataplane.ParseRules(bytes.NewReader(data))
	runtime.ReadMemStats(&after)
	if err != nil {
		b.Fatal(err)
	}
	runtime.KeepAlive(obs)
	return float64(after.HeapAlloc-before.HeapAlloc) / (1 << 20)
}

// BenchmarkIPTablesRead loads the 100k-endpoint ruleset into a scratch
// network namespace and compares, per backend:
//   - save+parse: one `iptables-save -t nat` (what the collector runs) and
//     the parse of its output, timed separately in the same iteration;
//     parse-% is the parse's overhead on top of the save;
//   - go-iptables-per-chain: the same information through go-iptables'
//     List (one iptables process per chain) for one service and its
//     endpoint chains; full-read-s extrapolates to every chain.
func BenchmarkIPTablesRead(b *testing.B) {
	if err := localcluster.CanRun(); err != nil {
		b.Skipf("needs root, iptables and nft: %v", err)
	}
	spec := benchSizes[len(benchSizes)-1].spec
	if os.Getenv("PROXYAUDIT_BENCH_SMALL") != "" {
		spec = benchSizes[1].spec
	}
	data := generate(b, spec, false)
	ctx := context.Background()
	for _, backend := range []struct{ name, restore, save, list string }{
		{"nf_tables", "iptables-restore", "iptables-save", "/usr/sbin/iptables"},
		{"legacy", "iptables-legacy-restore", "iptables-legacy-save", "/usr/sbin/iptables-legacy"},
	} {
		b.Run(backend.name, func(b *testing.B) {
			ns, err := localcluster.NewScratch(ctx, "bench")
			if err != nil {
				b.Fatal(err)
			}
			defer ns.Close()
			load := ns.Command(ctx, backend.restore)
			load.Stdin = bytes.NewReader(data)
			if out, err := load.CombinedOutput(); err != nil {
				b.Fatalf("load: %v: %s", err, out)
			}
			b.Run("save+parse", func(b *testing.B) {
				var save, parse time.Duration
				var n int64
				for b.Loop() {
					t0 := time.Now()
					out, err := ns.Command(ctx, backend.save, "-t", "nat").Output()
					if err != nil {
						b.Fatal(err)
					}
					t1 := time.Now()
					if _, err := dataplane.ParseRules(bytes.NewReader(out)); err != nil {
						b.Fatal(err)
					}
					save, parse, n = save+t1.Sub(t0), parse+time.Since(t1), n+int64(len(out))
				}
				b.SetBytes(n / int64(b.N))
				b.ReportMetric(save.Seconds()/float64(b.N), "save-s")
				b.ReportMetric(parse.Seconds()/float64(b.N), "parse-s")
				b.ReportMetric(100*parse.Seconds()/save.Seconds(), "parse-%")
			})
			b.Run("go-iptables-per-chain", func(b *testing.B) {
				var perService time.Duration
				err := localcluster.InNetNS(ns.NetNS, func() error {
					ipt, err := iptables.New(iptables.Path(backend.list))
					if err != nil {
						return err
					}
					svc := fmt.Sprintf("KUBE-SVC-%s", chainHash(data))
					for b.Loop() {
						t0 := time.Now()
						rules, err := ipt.List("nat", svc)
						if err != nil {
							return err
						}
						for _, r := range rules {
							if sep := jumpTarget(r); sep != "" {
								if _, err := ipt.List("nat", sep); err != nil {
									return err
								}
							}
						}
						perService += time.Since(t0)
					}
					return nil
				})
				if err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(perService.Seconds()/float64(b.N)*float64(spec.Services), "full-read-s")
			})
		})
	}
}

// chainHash returns the hash of the first service chain in a dump.
func chainHash(data []byte) string {
	i := bytes.Index(data, []byte(":KUBE-SVC-"))
	return string(data[i+10 : i+26])
}

func jumpTarget(rule string) string {
	i := bytes.LastIndex([]byte(rule), []byte(" -j KUBE-SEP-"))
	if i < 0 {
		return ""
	}
	return rule[i+4:]
}

// BenchmarkNFTRead loads the 100k-endpoint table into a scratch network
// namespace and times `nft -j list table ip kube-proxy` and the parse of its
// output in the same iteration.
func BenchmarkNFTRead(b *testing.B) {
	if err := localcluster.CanRun(); err != nil {
		b.Skipf("needs root, iptables and nft: %v", err)
	}
	spec := benchSizes[len(benchSizes)-1].spec
	if os.Getenv("PROXYAUDIT_BENCH_SMALL") != "" {
		spec = benchSizes[1].spec
	}
	listing, err := synth.NFTLoadOrder(generate(b, spec, true))
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	ns, err := localcluster.NewScratch(ctx, "bench")
	if err != nil {
		b.Fatal(err)
	}
	defer ns.Close()
	load := ns.Command(ctx, "nft", "-j", "-f", "-")
	load.Stdin = bytes.NewReader(listing)
	if out, err := load.CombinedOutput(); err != nil {
		b.Fatalf("load: %v: %s", err, out)
	}
	var list, parse time.Duration
	var n int64
	for b.Loop() {
		t0 := time.Now()
		out, err := ns.Command(ctx, "nft", "-j", "list", "table", "ip", "kube-proxy").Output()
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if _, err := dataplane.ParseRules(bytes.NewReader(out)); err != nil {
			b.Fatal(err)
		}
		list, parse, n = list+t1.Sub(t0), parse+time.Since(t1), n+int64(len(out))
	}
	b.SetBytes(n / int64(b.N))
	b.ReportMetric(list.Seconds()/float64(b.N), "list-s")
	b.ReportMetric(parse.Seconds()/float64(b.N), "parse-s")
	b.ReportMetric(100*parse.Seconds()/list.Seconds(), "parse-%")
}
