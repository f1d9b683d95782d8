package collector

import (
	"context"
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/nftables"
	"github.com/proxyaudit/proxyaudit/dataplane/nl"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// The netlink reader learns the maps kube-proxy's commits create from the
// change signal's notifications instead of dumping each, and what it reads
// so is exactly what a reader dumping every map reads: after kube-proxy's
// own changes, after a flush by hand and kube-proxy's restart (a table
// rewritten from scratch), and after a subscription overrun.
func TestE2ENotedMapsMatchDumps(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	n := c.Node("col-nft")
	apply := sigService(ctx, t, c)
	apply("198.18.131.1", "198.18.131.2")
	var sig *nl.GenSignal
	fed := nftables.NewNetlinkReader()
	onNode(t, n, func() error {
		s, err := nl.OpenGenSignal(DefaultNotifyBuffer)
		if err != nil {
			return err
		}
		sig = s
		sig.Feed(fed)
		_, err = fed.Read(ctx)
		return err
	})
	defer sig.Close()
	compare := func(what string) {
		t.Helper()
		// The commit's notifications reach the watcher within moments.
		time.Sleep(500 * time.Millisecond)
		noted0, dumped0 := fed.Counts().NotedMaps, fed.Counts().DumpedMaps
		var got, want *audit.Observed
		onNode(t, n, func() error {
			var err error
			if got, err = fed.Read(ctx); err != nil {
				return err
			}
			want, err = nftables.NewNetlinkReader().Read(ctx)
			return err
		})
		noted, dumped := fed.Counts().NotedMaps-noted0, fed.Counts().DumpedMaps-dumped0
		t.Logf("%s: maps new since the last read: %d from notifications, %d dumped", what, noted, dumped)
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s: the reader fed by notifications reads another model than one dumping every map", what)
		}
	}
	for k := range 4 {
		apply("198.18.131.1", fmt.Sprintf("198.18.131.%d", 10+k), fmt.Sprintf("198.18.131.%d", 20+k))
	}
	noted0 := fed.Counts().NotedMaps
	compare("after four changes by kube-proxy")
	if fed.Counts().NotedMaps == noted0 {
		t.Error("no map of kube-proxy's commits was learnt from notifications")
	}

	if err := n.FlushRules(ctx); err != nil {
		t.Fatal(err)
	}
	if err := n.RestartProxy(ctx); err != nil {
		t.Fatal(err)
	}
	apply("198.18.131.1", "198.18.131.2")
	compare("after a flush by hand and kube-proxy's restart")

	// An overrun (simulated: what the watcher does on ENOBUFS) forgets
	// what it learnt; the next read dumps and still agrees.
	apply("198.18.131.1", "198.18.131.3")
	fed.Lost()
	dumped0 := fed.Counts().DumpedMaps
	compare("after a lost notification")
	if fed.Counts().DumpedMaps == dumped0 {
		t.Error("after a lost notification the new maps were not dumped")
	}
}
