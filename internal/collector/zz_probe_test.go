package collector

import (
	"bytes"
	"context"
	"os"
	"runtime"
	"runtime/pprof"
	"testing"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

func TestZZHeap(t *testing.T) {
	spec := synth.Spec{Services: 10000, EndpointsPerService: 10}
	var ipt bytes.Buffer
	spec.WriteIPTablesSave(&ipt)
	ctx := context.Background()
	ns, _ := localcluster.NewScratch(ctx, "probe")
	defer ns.Close()
	if err := ns.RestoreIPTables(ctx, ipt.Bytes(), false); err != nil {
		t.Fatal(err)
	}
	ipt = bytes.Buffer{}
	var st *stream.State
	var r *iptNFTReader
	localcluster.InNetNS(ns.NetNS, func() error {
		r = newIPTNFTReader(nil)
		ch, err := r.ReadChanges(ctx)
		if err != nil {
			return err
		}
		st = stream.FromModel(ch.Whole)
		return nil
	})
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	t.Logf("heap in use %.1f MB, sys %.1f MB", float64(m.HeapInuse)/(1<<20), float64(m.Sys)/(1<<20))
	f, _ := os.Create("/tmp/heap.prof")
	pprof.WriteHeapProfile(f)
	f.Close()
	runtime.KeepAlive(st)
	runtime.KeepAlive(r)
}
