package fleetsim_test

import (
	"context"
	"runtime"
	"testing"
	"time"

	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
	"github.com/proxyaudit/proxyaudit/internal/fleetsim"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// BenchmarkInformerCache lists the anchors (10k Services, 10k
// EndpointSlices of 10 endpoints made the way the EndpointSlice controller
// makes them, 1,000 Nodes with a kubelet's status) from the real API server
// into the aggregator's three informers, without and with its Trim
// transform, and reports the heap the caches hold (MB-cache).
func BenchmarkInformerCache(b *testing.B) {
	c := localcluster.Shared(b)
	ctx := context.Background()
	cfg := *c.RESTConfig
	cfg.QPS, cfg.Burst = 2000, 4000
	client, err := kubernetes.NewForConfig(&cfg)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := fleetsim.Populate(ctx, client, synth.Spec{Services: 10000, EndpointsPerService: 10}, 1000, nodeName, 32); err != nil {
		b.Fatalf("populate: %v", err)
	}
	for _, trim := range []bool{false, true} {
		b.Run(map[bool]string{false: "untrimmed", true: "trimmed"}[trim], func(b *testing.B) {
			for b.Loop() {
				before := heap()
				var opts []informers.SharedInformerOption
				if trim {
					opts = append(opts, informers.WithTransform(view.Trim))
				}
				f := informers.NewSharedInformerFactoryWithOptions(client, 0, opts...)
				synced := []cache.InformerSynced{
					f.Core().V1().Services().Informer().HasSynced,
					f.Discovery().V1().EndpointSlices().Informer().HasSynced,
					f.Core().V1().Nodes().Informer().HasSynced,
				}
				stop := make(chan struct{})
				f.Start(stop)
				sctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
				ok := cache.WaitForCacheSync(sctx.Done(), synced...)
				cancel()
				if !ok {
					b.Fatal("informers did not sync")
				}
				b.ReportMetric(float64(heap()-before)/1e6, "MB-cache")
				close(stop)
				f.Shutdown()
			}
		})
	}
}

func heap() uint64 {
	for range 3 {
		runtime.GC()
	}
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}
