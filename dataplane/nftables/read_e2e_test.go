//go:build linux

package nftables

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// The kernel resumes a dump by position: a commit between two parts of a
// whole read that adds or deletes rules in a chain the dump already
// passed moves every later rule, and the dump skips or repeats rules of
// chains no commit touched (it flags such a dump NLM_F_DUMP_INTR). The
// notifications name only the chain that changed, so the reader never
// reads the others again: a whole read taken from an interrupted dump
// stays wrong (at 10k services under churn, a restored table read this
// way kept 100 frontends wrong for good). Here a writer grows and empties
// the table's first chain as fast as nft runs while whole reads are made
// of a 2,000-service table: every read must be the table's, and some dump
// must have been interrupted (else the test proves nothing).
func TestE2ENFTablesWholeReadUnderCommits(t *testing.T) {
	localcluster.NeedRoot(t, false)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ns, err := localcluster.NewScratch(ctx, "nftintr")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	// The writer's chain first, so it comes before every service's.
	if out, err := ns.Exec(ctx, "nft", "add table ip kube-proxy; add chain ip kube-proxy endpoint-0000-writer"); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	var dump bytes.Buffer
	if err := (synth.Spec{Services: 2000, EndpointsPerService: 10}).WriteNFTJSON(&dump); err != nil {
		t.Fatal(err)
	}
	if err := localcluster.LoadNFT(ctx, ns.NetNS, dump.Bytes()); err != nil {
		t.Fatal(err)
	}
	read := func(r *NetlinkReader) *stream.State {
		t.Helper()
		var obs *audit.Observed
		if err := localcluster.InNetNS(ns.NetNS, func() error {
			var err error
			obs, err = r.Read(ctx)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return stream.FromModel(obs)
	}
	want := read(NewNetlinkReader())
	if want.Len() != 2000 {
		t.Fatalf("the quiet table read as %d frontends", want.Len())
	}

	wctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	commits := 0
	go func() {
		defer wg.Done()
		grow := strings.Repeat("add rule ip kube-proxy endpoint-0000-writer counter\n", 200)
		for i := 0; wctx.Err() == nil; i++ {
			script := grow
			if i%2 == 1 {
				script = "flush chain ip kube-proxy endpoint-0000-writer\n"
			}
			cmd := ns.Command(wctx, "nft", "-f", "-")
			cmd.Stdin = strings.NewReader(script)
			if cmd.Run() == nil {
				commits++
			}
		}
	}()
	r := NewNetlinkReader()
	reads := 0
	for deadline := time.Now().Add(40 * time.Second); time.Now().Before(deadline) && (reads < 10 || r.interrupted.Load() < 3); reads++ {
		got := read(r)
		var differ []string
		stream.ChangedKeys(got, want, func(k string) { differ = append(differ, k) })
		if len(differ) > 0 || got.Root() != want.Root() {
			if len(differ) > 5 {
				differ = append(differ[:5], "…")
			}
			t.Fatalf("read %d under commits (%d dumps interrupted so far) is not the table's: %d frontends (want %d), these differ: %v",
				reads, r.interrupted.Load(), got.Len(), want.Len(), differ)
		}
	}
	stop()
	wg.Wait()
	t.Logf("%d whole reads under %d commits: %d dumps interrupted and asked again, %d reads made chain by chain",
		reads, commits, r.interrupted.Load(), r.byChain.Load())
	if r.interrupted.Load() == 0 {
		t.Error("no dump was interrupted: the test did not meet what it is about")
	}
}
