package aggregator

import (
	"context"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/conntrack"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/collector"
	"github.com/proxyaudit/proxyaudit/internal/collector/collectortest"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
	"github.com/proxyaudit/proxyaudit/remediate"
	"github.com/proxyaudit/proxyaudit/remediate/effect"
)

// fakeConntrack is a node's conntrack table as the kernel reader would
// count it (the reader itself is tested on a real kernel).
type fakeConntrack struct {
	mu    sync.Mutex
	flows []audit.ConntrackFlows
	err   error
	asked []conntrack.FlushTarget
}

func (f *fakeConntrack) Read(context.Context, []audit.FrontendKey) (*audit.Conntrack, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		return nil, f.err
	}
	return &audit.Conntrack{Families: []int{4}, Entries: 1, Flows: append([]audit.ConntrackFlows(nil), f.flows...)}, nil
}

func (f *fakeConntrack) set(flows []audit.ConntrackFlows, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.flows, f.err = flows, err
}

// Through the stream to the verdict: flows still DNATed to an address
// that is no endpoint of the service become a StaleConntrack finding once
// grace has passed, counted on the node, whose rules stay in sync (its
// state does not change: restarting kube-proxy is not the repair); flows
// to live endpoints are nothing; once the flows are gone, so is the
// finding; a table that cannot be read is a warning on the node.
func TestStaleConntrackThroughTheStream(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := start(t, 2*time.Second, auth.InsecureNoAuth{})
		o := rules(t)
		var fe audit.ObservedFrontend
		for _, f := range o.Frontends {
			if !f.NodePort && len(f.Endpoints) > 0 {
				fe = f
				break
			}
		}
		live := ConntrackFlowsOf(fe.FrontendKey, fe.Endpoints[0].Addr, 7)
		dead := ConntrackFlowsOf(fe.FrontendKey, netip.AddrPortFrom(netip.MustParseAddr("198.18.250.250"), fe.Endpoints[0].Addr.Port()), 3)
		ct := &fakeConntrack{}
		ct.set([]audit.ConntrackFlows{live, dead}, nil)
		for _, name := range []string{"n1", "n2", "n3"} {
			cfg := collector.Config{Node: name, Aggregator: h.addr, Interval: time.Second, CPUTime: noCPU, Clock: h.clk, Dial: h.net.Dial, Log: zaptest.NewLogger(t).Named(name),
				Reader: &collectortest.Reader{Rules: func() (*audit.Observed, error) { return rules(t), nil }}}
			if name == "n3" {
				cfg.Conntrack, cfg.ConntrackInterval = ct, time.Second
			}
			h.wg.Add(1)
			go func() { defer h.wg.Done(); collector.Run(h.ctx, cfg) }()
		}
		stale := func() []audit.TimedFinding {
			var out []audit.TimedFinding
			for _, f := range h.verdict().Findings {
				if f.Kind == audit.StaleConntrack {
					out = append(out, f)
				}
			}
			return out
		}
		h.until(time.Minute, "a StaleConntrack finding on n3", func() bool { return len(stale()) == 1 })
		f := stale()[0]
		if f.Node != "n3" || f.Endpoint != dead.Dest.String() || f.Flows != 3 || f.Found.IsZero() || f.Protocol != fe.Protocol {
			t.Errorf("finding: %+v", f)
		}
		for _, n := range h.verdict().Nodes {
			if n.State != audit.NodeInSync {
				t.Errorf("%s is %s: stale flows must not change a node's state", n.Node, n.State)
			}
			if n.Node == "n3" && n.StaleFlows != 3 {
				t.Errorf("n3 counts %d stale flows", n.StaleFlows)
			}
		}
		// explain shows them under the port whose endpoint they point to.
		ex, ok := h.agg.Explain("n3", "")
		shownUnder := ""
		for _, p := range ex.Ports {
			for _, s := range p.StaleFlows {
				if s.Endpoint == dead.Dest.String() && s.Flows == 3 {
					shownUnder = p.Service
				}
			}
		}
		if !ok || shownUnder != f.Service {
			t.Errorf("explain node n3 shows the stale flows under %q, want %q", shownUnder, f.Service)
		}
		// The flows end (their client stopped, or someone deleted them).
		ct.set([]audit.ConntrackFlows{live}, nil)
		h.until(time.Minute, "the finding gone with the flows", func() bool { return len(stale()) == 0 })
		ct.set(nil, errTable)
		h.until(time.Minute, "a warning that n3's table cannot be read", func() bool {
			for _, n := range h.verdict().Nodes {
				for _, w := range n.Warnings {
					if n.Node == "n3" && w == "conntrack could not be read, stale flows are not audited: "+errTable.Error() {
						return true
					}
				}
			}
			return false
		})
	})
}

var errTable = &tableError{}

type tableError struct{}

func (*tableError) Error() string { return "conntrack: netlink socket: operation not permitted" }

// ConntrackFlowsOf is n flows of a frontend to dest: UDP, or TCP clients
// trying to connect (SYN_SENT).
func ConntrackFlowsOf(k audit.FrontendKey, dest netip.AddrPort, n int) audit.ConntrackFlows {
	f := audit.ConntrackFlows{Frontend: k, Dest: dest, Samples: []netip.AddrPort{netip.MustParseAddrPort("198.18.5.5:40000")}}
	if k.Protocol == "TCP" {
		f.TCP, f.Unreplied = map[string]int{"SYN_SENT": n}, n
	} else {
		f.UDP = n
	}
	return f
}

// Delete deletes the flows of each target, as the kernel would, and
// remembers what it was asked.
func (f *fakeConntrack) Delete(_ context.Context, ts []conntrack.FlushTarget) ([]int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.asked = append(f.asked, ts...)
	out := make([]int, len(ts))
	kept := f.flows[:0:0]
	for _, fl := range f.flows {
		gone := false
		for i, t := range ts {
			if fl.Frontend == t.Frontend && fl.Dest == t.Dest {
				out[i] += fl.Total()
				gone = true
			}
		}
		if !gone {
			kept = append(kept, fl)
		}
	}
	f.flows = kept
	return out, nil
}

// Conntrack remediation from the finding to the node and back: in
// dry-run it says what it would delete and deletes nothing; in restart
// mode the node's collector is asked to delete exactly the stale pair
// (never the live one), kube-proxy is not restarted (the node's rules are
// in sync), the finding goes with the flows, the flush is recorded for the
// node's budget; a collector whose operator left deletion off refuses,
// and that is paged as refused.
func TestStaleConntrackFlushedThroughTheStream(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mode   remediate.Mode
		delete bool
	}{{"dry-run", remediate.DryRun, true}, {"restart", remediate.Restart, true}, {"deletion off on the node", remediate.Restart, false}} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				client := fakeCluster()
				h := startWith(t, 2*time.Second, auth.InsecureNoAuth{}, client, nil)
				o := rules(t)
				var fe audit.ObservedFrontend
				for _, f := range o.Frontends {
					if !f.NodePort && f.IP == synth.VIP(0) {
						fe = f
					}
				}
				live := ConntrackFlowsOf(fe.FrontendKey, fe.Endpoints[0].Addr, 7)
				dead := ConntrackFlowsOf(fe.FrontendKey, netip.AddrPortFrom(netip.MustParseAddr("198.18.250.250"), fe.Endpoints[0].Addr.Port()), 3)
				ct := &fakeConntrack{}
				ct.set([]audit.ConntrackFlows{live, dead}, nil)
				rec := &kinds{}
				p := remediate.DefaultPolicy()
				p.Mode, p.MaxUnhealthy, p.Conntrack.Enabled = tc.mode, remediate.MustBudget("100%"), true
				// The synthetic services are TCP: opted in (their connection
				// attempts to a gone pod, SYN_SENT, are what is judged).
				p.Conntrack.TCPServices = map[string]bool{synth.Namespace + "/" + synth.ServiceName(0): true}
				ex := &effect.Executor{Client: client, Policy: p, Notifier: rec, Clock: h.clk, Log: zaptest.NewLogger(t), ProxyNamespace: "kube-system", ProxySelector: "k8s-app=kube-proxy",
					Incidents: &effect.Incidents{Client: client, Namespace: "proxyaudit", Name: "proxyaudit-incidents"}}
				h.agg.cfg.Remediation = &Remediation{Policy: p, Executor: ex}
				for _, name := range []string{"n1", "n2", "n3"} {
					cfg := collector.Config{Node: name, Aggregator: h.addr, Interval: time.Second, CPUTime: noCPU, Clock: h.clk, Dial: h.net.Dial, Log: zaptest.NewLogger(t).Named(name),
						Reader: &collectortest.Reader{Rules: func() (*audit.Observed, error) { return rules(t), nil }}}
					if name == "n3" {
						cfg.Conntrack, cfg.ConntrackInterval, cfg.ConntrackDelete = ct, time.Second, tc.delete
					}
					h.wg.Add(1)
					go func() { defer h.wg.Done(); collector.Run(h.ctx, cfg) }()
				}
				h.until(time.Minute, "a flush decided for n3", func() bool {
					return rec.count("n3", remediate.FlushConntrack) > 0 || rec.count("n3", remediate.Page) > 0
				})
				all, _ := rec.since(0)
				var flush remediate.Notice
				for _, x := range all {
					if x.Node == "n3" && (flush.Kind == "" || x.Kind == remediate.FlushConntrack) {
						flush = x
					}
					if x.Node == "n3" && x.Kind == remediate.Page && tc.delete {
						t.Errorf("paged after the flush: %s", x.Reason)
					}
					if x.Node != "n3" || x.Kind == remediate.RestartProxy {
						t.Errorf("unexpected action %s on %s: %s", x.Kind, x.Node, x.Reason)
					}
				}
				ct.mu.Lock()
				asked := append([]conntrack.FlushTarget(nil), ct.asked...)
				ct.mu.Unlock()
				switch {
				case tc.mode == remediate.DryRun:
					if flush.Kind != remediate.FlushConntrack || !flush.DryRun || len(asked) != 0 || !strings.Contains(flush.Reason, dead.Dest.String()) {
						t.Fatalf("dry-run: %+v; asked %v", flush, asked)
					}
				case !tc.delete:
					h.until(20*time.Second, "the refusal paged", func() bool {
						all, _ := rec.since(0)
						for _, x := range all {
							if x.Kind == remediate.FlushConntrack && strings.Contains(x.Reason, "FAILED") && strings.Contains(x.Reason, "--conntrack-delete") {
								return true
							}
						}
						return false
					})
				default:
					if len(asked) != 1 || asked[0].Frontend != fe.FrontendKey || asked[0].Dest != dead.Dest || !asked[0].TCP {
						t.Fatalf("asked to delete %+v, want only %v → %v", asked, fe.FrontendKey, dead.Dest)
					}
					if !strings.Contains(flush.Reason, "deleted 3 entries") || flush.DryRun {
						t.Fatalf("flush: %+v", flush)
					}
					h.until(20*time.Second, "the finding gone with the flows", func() bool {
						for _, f := range h.verdict().Findings {
							if f.Kind == audit.StaleConntrack {
								return false
							}
						}
						return true
					})
					if inc := ex.Incident("n3"); len(inc.Flushes) != 1 || inc.Stage != "" {
						t.Fatalf("recorded %+v", inc)
					}
					// Between the flush and the collector's next counts, the
					// stale pair is still in the verdict: waited out, not paged.
					if n := rec.count("n3", remediate.Page); n != 0 {
						t.Errorf("%d page(s) after the flush", n)
					}
				}
			})
		})
	}
}

// TestTheWelcomeComesFirst: a flush (or read-now, or peers list) sent to
// a node while its new stream opens must not reach the collector before
// the stream's welcome: the collector reads the answer to its hello
// first, and anything else there ends its stream. Nor may the welcome
// come before the stream is the node's (a flush right after it would find
// no stream). The window between registering and welcoming is widened
// with a hook: a flush is sent in it, and the hook returns once the flush
// is registered, its send next.
func TestTheWelcomeComesFirst(t *testing.T) {
	h := start(t, 2*time.Second, tokens)
	pair := remediate.StalePair{Service: "kube-system/kube-dns", Port: "dns", Protocol: "UDP",
		Frontend: audit.FrontendKey{IP: netip.MustParseAddr("198.18.96.10"), Protocol: "UDP", Port: 53}.Wire(), Dest: "198.18.200.7:53", Flows: 3}
	flush := func(wait time.Duration) error {
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		defer cancel()
		_, err := h.agg.Flush(ctx, "n1", []remediate.StalePair{pair})
		return err
	}
	var flushes sync.WaitGroup
	defer flushes.Wait()
	registered := func() uint64 { // flush IDs given so far
		h.agg.flush.mu.Lock()
		defer h.agg.flush.mu.Unlock()
		return h.agg.flush.next
	}
	hook := func() {
		before := registered()
		flushes.Go(func() { flush(2 * time.Second) }) // nobody answers it
		// Registered, the flush's next step is its send, which waits
		// for the welcome this stream's registration is writing.
		testkit.Eventually(t, 5*time.Second, "the flush registered", func() bool { return registered() > before })
	}
	h.agg.testHookRegistered.Store(&hook)
	for i := range 3 {
		c := h.dial("n1")
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		m, _, err := stream.Read(c, 1<<20)
		if err != nil || m.Type != stream.TypeWelcome {
			t.Fatalf("stream %d: the first message is %+v (%v), want the welcome", i, m, err)
		}
		if m, _, err = stream.Read(c, 1<<20); err != nil || m.Type != stream.TypeFlush {
			t.Fatalf("stream %d: after the welcome %+v (%v), want the flush that waited for it", i, m, err)
		}
		// Once welcomed, the stream is the node's: a flush goes to it.
		if err := flush(time.Millisecond); err != nil && strings.Contains(err.Error(), "no collector") {
			t.Fatalf("stream %d: welcomed, yet %v", i, err)
		}
		c.Close()
	}
}
