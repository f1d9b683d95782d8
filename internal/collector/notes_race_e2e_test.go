package collector

import (
	"context"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/iptables"
	"github.com/proxyaudit/proxyaudit/dataplane/nftables"
	"github.com/proxyaudit/proxyaudit/dataplane/nl"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// gateSink passes notifications on to a reader's sink until armed; then,
// after pass more, it holds the watcher (and so the rest of the commit's
// notifications, its NEWGEN among them) until released.
type gateSink struct {
	NotificationSink
	mu      sync.Mutex
	armed   bool
	pass    int
	held    chan struct{}
	release chan struct{}
}

func (g *gateSink) Note(typ, flags uint16, data []byte) {
	g.mu.Lock()
	hold := false
	if g.armed {
		if g.pass == 0 {
			hold, g.armed = true, false
		} else {
			g.pass--
		}
	}
	g.mu.Unlock()
	if hold {
		close(g.held)
		<-g.release
	}
	g.NotificationSink.Note(typ, flags, data)
}

func (g *gateSink) Subscribed(on bool) {
	if s, ok := g.NotificationSink.(interface{ Subscribed(bool) }); ok {
		s.Subscribed(on)
	}
}

func (g *gateSink) arm(pass int) {
	g.mu.Lock()
	g.armed, g.pass = true, pass
	g.held, g.release = make(chan struct{}), make(chan struct{})
	g.mu.Unlock()
}

// A read can come (a heartbeat, the aggregator's read-now) while a
// commit's notifications are still reaching the reader: it reads the
// chains named so far, and the kernel's generation has already moved past
// that commit. The rest of the commit, its NEWGEN last, must still cause a
// read. Before, the client took the kernel's generation as read, the
// NEWGEN found nothing new, and the rest of the commit waited for the next
// one: on a quiet node after `iptables -t nat -F` at the anchors, the
// flush was never reported.
func TestE2EReadWhileACommitsNotesArrive(t *testing.T) {
	localcluster.NeedRoot(t, false)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	for _, mode := range []string{"iptables", "nftables"} {
		t.Run(mode, func(t *testing.T) {
			ns, err := localcluster.NewScratch(ctx, "notesrace")
			if err != nil {
				t.Fatal(err)
			}
			defer ns.Close()
			inNS := func(f func() error) {
				t.Helper()
				if err := localcluster.InNetNS(ns.NetNS, f); err != nil {
					t.Fatal(err)
				}
			}
			src, load, commit := notesRaceTables(t, ctx, ns, mode)
			load()
			c := &client{cfg: Config{Log: zap.NewNop(), Clock: clock.RealClock{}, FullReadInterval: time.Hour, Interval: 10 * time.Second}, fed: true,
				credit: newReadCredit(DefaultReadBudget, time.Second, 10*time.Second)}
			c.cost.Reads = map[stream.ReadReason]uint64{}
			var sig *nl.GenSignal
			gate := &gateSink{}
			inNS(func() error {
				c.reader = NewHost().Reader(src)
				s, err := nl.OpenGenSignal(DefaultNotifyBuffer)
				if err != nil {
					return err
				}
				sig = s
				gate.NotificationSink = c.reader.(NotificationSink)
				sig.Feed(gate)
				c.signal = sig
				return c.read(ctx, stream.ReadResync)
			})
			defer sig.Close()
			whole := func() *stream.State {
				var obs *audit.Observed
				inNS(func() error {
					var err error
					obs, err = NewHost().Reader(src).Read(ctx)
					return err
				})
				return stream.FromModel(obs)
			}
			if c.cached.Root() != whole().Root() {
				t.Fatal("the first read is not a whole read's model")
			}

			// The commit's first notifications pass, the rest wait; a read
			// comes meanwhile.
			gate.arm(10)
			commit()
			select {
			case <-gate.held:
			case <-time.After(10 * time.Second):
				t.Fatal("the commit's notifications did not arrive")
			}
			if why := c.Due(""); why != stream.ReadChange {
				t.Fatalf("after a commit, due says %q", why)
			}
			inNS(func() error { return c.read(ctx, stream.ReadChange) })
			if c.cached.Root() == whole().Root() {
				t.Fatal("the read in the middle of the commit's notifications already shows all of it: the test proves nothing")
			}
			close(gate.release)
			// The rest of the commit arrives, the NEWGEN last.
			restArrives(t, c, sig)
			why := c.Due("")
			if why != stream.ReadChange {
				t.Fatalf("the rest of the commit arrived and due says %q: the node would show half a commit until the next one", why)
			}
			inNS(func() error { return c.read(ctx, why) })
			if want := whole(); c.cached.Root() != want.Root() {
				var differ []string
				stream.ChangedKeys(c.cached, want, func(k string) { differ = append(differ, k) })
				t.Fatalf("after the rest of the commit, the model differs from a whole read in %d frontends: %v", len(differ), differ)
			}
			if why := c.Due(""); why != "" {
				t.Errorf("caught up, and due still says %q", why)
			}
			t.Logf("reads: %v", c.cost.Reads)
		})
	}
}

// notesRaceTables makes the table of 30 services to load in mode, and a
// commit that gives each of them new endpoints.
func notesRaceTables(t *testing.T, ctx context.Context, ns *localcluster.Scratch, mode string) (src Source, load, commit func()) {
	switch mode {
	case "iptables":
		tb := &churnTable{fam: 4, rng: rand.New(rand.NewPCG(3, 5)), services: make([][]churnEndpoint, 30)}
		for i := range tb.services {
			tb.services[i] = tb.newEndpoints(i)
		}
		restore := func(in string) {
			t.Helper()
			cmd := ns.Command(ctx, "iptables-restore", "--noflush")
			cmd.Stdin = strings.NewReader(in)
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("iptables-restore: %v: %s", err, out)
			}
		}
		return Source{Mode: audit.ModeIPTables}, func() { restore(tb.sync(nil, true)) }, func() {
			all := make([]int, len(tb.services))
			for i := range all {
				all[i] = i
			}
			restore(tb.sync(all, false))
		}
	default:
		tb := &nftChurn{fam: 4, services: 30, rng: rand.New(rand.NewPCG(3, 5))}
		apply := func(in string) {
			t.Helper()
			cmd := ns.Command(ctx, "nft", "-f", "-")
			cmd.Stdin = strings.NewReader(in)
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("nft: %v: %s\n%s", err, out, in)
			}
		}
		return Source{Mode: audit.ModeNFTables}, func() { apply(tb.base()) }, func() {
			var all strings.Builder
			for i := range tb.services {
				all.WriteString(tb.rewrite(i))
			}
			apply(all.String())
		}
	}
}

// restArrives waits until the reader has every notification of the
// kernel's current generation.
func restArrives(t *testing.T, c *client, sig *nl.GenSignal) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		tok, err := sig.Token()
		if err != nil {
			t.Fatal(err)
		}
		var caughtUp func(uint64) bool
		switch r := c.reader.(type) {
		case *iptables.NFTReader:
			caughtUp = r.CaughtUp
		case *nftables.NetlinkReader:
			caughtUp = r.CaughtUp
		}
		if caughtUp(tok) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the rest of the commit's notifications did not arrive")
		}
	}
}
