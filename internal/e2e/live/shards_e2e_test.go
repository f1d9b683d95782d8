package live

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/api"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/shard"
	"github.com/proxyaudit/proxyaudit/internal/testkit/findings"
)

// shardedReplicas are the sharded test's replicas; the fourth joins later.
var shardedReplicas = []string{"198.18.1.1", "198.18.1.2", "198.18.1.3"}

const (
	// shardCount: the three nodes fall in shards 0, 1 and 2 of three, so
	// each replica holds one node, a frozen node is always on a replica
	// that does not lead, and the newcomer always takes a node's shard.
	shardCount = 3
	newcomer   = "198.18.1.4"
)

// Three replicas of the chart sharing the fleet (issue #41) in three
// shards, on the real cluster with real collectors and kube-proxies:
//   - every node streams to the replica holding its shard's Lease, and
//     only that replica's partial verdict holds it; the internal API
//     admits only the aggregator's own ServiceAccount;
//   - a frozen kube-proxy on a node another replica holds is found by the
//     leader on that node only, and explained through the leader;
//   - a replica (holding nodes, not leading) SIGKILLed: its shards move,
//     its nodes are heard again, the other nodes' streams are untouched and
//     never unheard, and nothing is reported;
//   - a fourth replica joins: it takes a share of the shards, only the
//     nodes of those shards reconnect, and nothing is reported.
func TestE2EShardedReplicas(t *testing.T) {
	ctx := context.Background()
	l := newLiveOn(ctx, t, localcluster.Shared(t), liveNodes, shardedReplicas, "aggregator.replicas=3", fmt.Sprintf("aggregator.shards=%d", shardCount))
	peerToken := l.peerToken(ctx, "proxyaudit-aggregator")

	holders := l.waitShardsHeld(t, len(shardedReplicas))
	leader := l.fleetLeader(ctx, t)
	t.Logf("fleet leader %s; nodes' holders: %v", leader, nodeHolders(holders))
	l.checkPartials(t, peerToken, holders)

	// The internal API is the replicas' alone.
	for _, c := range []struct {
		who, token string
		want       int
	}{{"no token", "", http.StatusUnauthorized}, {"a reader's token (another audience)", l.reader, http.StatusUnauthorized}, {"garbage", "x.y.z", http.StatusUnauthorized},
		{"the collectors' account's token for the peers' audience", l.peerToken(ctx, sa), http.StatusForbidden}} {
		if code, body := l.internalGet(shardedReplicas[0], "/internal/v1/partial", c.token); code != c.want {
			t.Errorf("internal API with %s: %d, want %d: %s", c.who, code, c.want, body)
		}
	}

	t.Run("a frozen node on another replica's shard", func(t *testing.T) {
		victim := ""
		for _, s := range l.specs {
			if holders[s.Name] != leader+":9443" {
				victim = s.Name
				break
			}
		}
		if victim == "" {
			t.Fatalf("every node's shard is the leader's (%s): with three shards for three replicas each holds one", nodeHolders(holders))
		}
		n := l.c.Node(victim)
		thaw, err := n.Freeze(ctx)
		if err != nil {
			t.Fatal(err)
		}
		l.epoch++
		for i := range 3 {
			if err := l.setEndpoints(ctx, i, l.epoch); err != nil {
				thaw(ctx)
				t.Fatal(err)
			}
		}
		took := l.waitFor("drift on "+victim+" only", grace+2*interval+30*time.Second, func(fs []audit.TimedFinding) bool {
			return len(fs) > 0 && len(findings.Only(fs, victim)) == len(fs) && (findings.Has(fs, victim, audit.StuckProxy) || findings.Has(fs, victim, audit.StaleEndpoint))
		})
		t.Logf("%s (held by %s) found by the leader %s %s after the change", victim, holders[victim], leader, took.Round(100*time.Millisecond))
		req, _ := http.NewRequest(http.MethodGet, "http://"+leader+":8080/api/v1/nodes/"+victim+"/explain", nil)
		req.Header.Set("X-Proxyaudit-Token", l.reader)
		if resp, err := l.http.Do(req); err != nil {
			t.Errorf("explain %s on the leader: %v", victim, err)
		} else {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			var ex api.ExplainResponse
			if err := json.Unmarshal(body, &ex); resp.StatusCode != http.StatusOK || err != nil || ex.Node != victim || len(ex.Ports) == 0 {
				t.Errorf("explain %s on the leader: %s %s", victim, resp.Status, body)
			}
			t.Logf("explain %s on the leader (its rules are on %s): %s, %d ports traced", victim, holders[victim], resp.Status, len(ex.Ports))
		}
		if err := thaw(ctx); err != nil {
			t.Fatal(err)
		}
		if err := n.RestartProxy(ctx); err != nil {
			t.Fatal(err)
		}
		l.waitAllInSync(victim + " thawed")
	})

	t.Run("a replica killed", func(t *testing.T) {
		holders := l.waitShardsHeld(t, len(shardedReplicas))
		leader := l.fleetLeader(ctx, t)
		victim := ""
		for _, s := range l.specs {
			if h := strings.TrimSuffix(holders[s.Name], ":9443"); h != leader {
				victim = h
				break
			}
		}
		if victim == "" {
			t.Fatalf("every node's shard is the leader's (%v): with three shards for three replicas each holds one", nodeHolders(holders))
		}
		var moved, stayed []string
		for _, s := range l.specs {
			if strings.TrimSuffix(holders[s.Name], ":9443") == victim {
				moved = append(moved, s.Name)
			} else {
				stayed = append(stayed, s.Name)
			}
		}
		before := l.streamsOpened()
		watch := l.watchNodes(stayed)
		killed := time.Now()
		l.aggs[victim].Kill()
		t.Logf("SIGKILLed replica %s, holding %v", victim, moved)
		back := map[string]time.Duration{}
		for deadline := time.Now().Add(90 * time.Second); len(back) < len(moved) && time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
			ns := l.nodes()
			for _, name := range moved {
				if _, ok := back[name]; !ok && ns[name].State == audit.NodeInSync && ns[name].LastReport.After(killed) {
					back[name] = time.Since(killed)
				}
			}
		}
		bad := watch.stop()
		if len(back) < len(moved) {
			t.Fatalf("the killed replica's nodes %v not heard again within 90 s (back: %v)\n%s", moved, back, l.logs())
		}
		t.Logf("the killed replica's nodes heard again, in sync: %v", back)
		if bad != "" {
			t.Errorf("a node the killed replica did not hold was unheard, or something was reported: %s", bad)
		}
		after := l.streamsOpened()
		for _, name := range stayed {
			if after[name] != before[name] {
				t.Errorf("%s's collector reconnected (%d → %d streams) though its shard did not move", name, before[name], after[name])
			}
		}
		l.replicas = slices.DeleteFunc(slices.Clone(l.replicas), func(ip string) bool { return ip == victim })
	})

	t.Run("a replica joins", func(t *testing.T) {
		// The killed replica's membership expires first: the newcomer's
		// quota is counted among the live ones.
		holdersBefore := l.waitShardsHeld(t, len(l.replicas))
		before := l.streamsOpened()
		watch := l.watchNodes(nil)
		if err := l.c.AddHostAddress(ctx, newcomer); err != nil {
			t.Fatal(err)
		}
		l.startAggregator(newcomer)
		l.replicas = append(l.replicas, newcomer)
		joined := time.Now()
		var holders map[string]string
		for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(250 * time.Millisecond) {
			byReplica := l.shardHolders(ctx, t)
			if n := len(byReplica[newcomer+":9443"]); n >= shardCount/len(l.replicas) {
				t.Logf("the newcomer holds %d shards %s after it started: %v", n, time.Since(joined).Round(100*time.Millisecond), byReplica[newcomer+":9443"])
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the newcomer holds %v after 60 s\n%s", byReplica[newcomer+":9443"], l.logs())
			}
		}
		holders = l.waitShardsHeld(t, len(l.replicas))
		// The leader keeps a holder's last partial for 10 s, so the fleet
		// can look in sync before a moved node's collector reconnected:
		// wait for those reconnects first.
		for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(250 * time.Millisecond) {
			now, waiting := l.streamsOpened(), false
			for _, s := range l.specs {
				if holders[s.Name] != holdersBefore[s.Name] && now[s.Name] == before[s.Name] {
					waiting = true
				}
			}
			if !waiting {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("a moved node's collector did not reconnect within 60 s (holders %s)\n%s", nodeHolders(holders), l.logs())
			}
		}
		l.waitAllInSync("every node in sync after the newcomer joined")
		if bad := watch.stop(); bad != "" {
			t.Errorf("something was reported while a replica joined: %s", bad)
		}
		after := l.streamsOpened()
		t.Logf("nodes' holders before the newcomer: %s; after: %s", nodeHolders(holdersBefore), nodeHolders(holders))
		if !slices.ContainsFunc(l.specs, func(s localcluster.NodeSpec) bool { return holders[s.Name] == newcomer+":9443" }) {
			t.Errorf("no node's shard moved to the newcomer (holders %s)", nodeHolders(holders))
		}
		for _, s := range l.specs {
			movedNode := holders[s.Name] != holdersBefore[s.Name]
			if reconnected := after[s.Name] != before[s.Name]; reconnected != movedNode {
				t.Errorf("%s: shard moved %v (%s → %s), collector reconnected %v (%d → %d streams)", s.Name, movedNode, holdersBefore[s.Name], holders[s.Name],
					reconnected, before[s.Name], after[s.Name])
			}
		}
		l.checkPartials(t, l.peerToken(ctx, "proxyaudit-aggregator"), holders)
	})

	// The leader reads the others' partials as changes since its last
	// read, not whole each second (a whole read after each holder's start
	// or restart only).
	t.Run("the leader reads changes", func(t *testing.T) {
		m := l.metrics(t)
		full, changes, reads := m[`proxyaudit_partial_read_bytes_total{kind="full"}`], m[`proxyaudit_partial_read_bytes_total{kind="changes"}`], m[`proxyaudit_partial_reads_total{outcome="ok"}`]
		t.Logf("the leader's partial reads: %.0f, %.0f bytes whole, %.0f as changes (%.0f bytes a read)", reads, full, changes, (full+changes)/max(reads, 1))
		// Whole: once per holder's run (two at the start, the one that
		// took the killed replica's shard, the newcomer), each ~1.4 KB.
		if changes == 0 || full > 6*1500 {
			t.Errorf("the leader read %.0f bytes whole and %.0f as changes in %.0f reads: want a whole read per holder's run at most, changes otherwise", full, changes, reads)
		}
	})
}

// nodeHolders prints holders sorted.
func nodeHolders(h map[string]string) string {
	var out []string
	for n, r := range h {
		out = append(out, n+"→"+r)
	}
	slices.Sort(out)
	return strings.Join(out, " ")
}

// peerToken is a token of the aggregator's ServiceAccount for the API
// server's own audience, as a replica's pod has.
// peerToken is a token of account for the peers' audience, as the chart
// projects the aggregator's into each replica.
func (l *live) peerToken(ctx context.Context, account string) string {
	l.t.Helper()
	exp := int64(3600)
	tr, err := l.c.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, account, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		ExpirationSeconds: &exp, Audiences: []string{auth.DefaultPeerAudience}}}, metav1.CreateOptions{})
	if err != nil {
		l.t.Fatal(err)
	}
	return tr.Status.Token
}

// internalGet asks a replica's internal API as another replica does: over
// TLS on its own port, verified against the chart's CA and the peers
// Service's name.
func (l *live) internalGet(ip, path, token string) (int, []byte) {
	cfg := l.tlsConfig(l.t)
	cfg.ServerName = "proxyaudit-aggregator-headless." + ns + ".svc"
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: cfg}}
	defer hc.CloseIdleConnections()
	req, _ := http.NewRequest(http.MethodGet, "https://"+ip+":8444"+path, nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return 0, []byte(err.Error())
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, body
}

// shardHolders reads the shard Leases: the shards each replica holds.
func (l *live) shardHolders(ctx context.Context, t *testing.T) map[string][]int {
	leases, err := l.c.Client.CoordinationV1().Leases(ns).List(ctx, metav1.ListOptions{
		LabelSelector: fmt.Sprintf("%s=shard,%s=proxyaudit-aggregator-%d", shard.LabelKind, shard.LabelSet, shardCount)})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]int{}
	for _, le := range leases.Items {
		if le.Spec.HolderIdentity == nil || *le.Spec.HolderIdentity == "" {
			continue
		}
		var k int
		if _, err := fmt.Sscanf(le.Labels[shard.LabelShard], "%d", &k); err == nil {
			out[*le.Spec.HolderIdentity] = append(out[*le.Spec.HolderIdentity], k)
		}
	}
	return out
}

// waitShardsHeld waits until every shard is held and replicas replicas
// hold them, and returns each node's holder (its stream address).
func (l *live) waitShardsHeld(t *testing.T, replicas int) map[string]string {
	t.Helper()
	ctx := context.Background()
	for deadline := time.Now().Add(90 * time.Second); ; time.Sleep(250 * time.Millisecond) {
		byReplica := l.shardHolders(ctx, t)
		of := map[int]string{}
		for r, ks := range byReplica {
			for _, k := range ks {
				of[k] = r
			}
		}
		if len(of) == shardCount && len(byReplica) == replicas {
			out := map[string]string{}
			for _, s := range l.specs {
				out[s.Name] = of[shard.Of(s.Name, shardCount)]
			}
			return out
		}
		if time.Now().After(deadline) {
			t.Fatalf("shards not all held by %d replicas after 90 s: %v\n%s", replicas, byReplica, l.logs())
		}
	}
}

// fleetLeader is the replica holding the fleet Lease.
func (l *live) fleetLeader(ctx context.Context, t *testing.T) string {
	le, err := l.c.Client.CoordinationV1().Leases(ns).Get(ctx, "proxyaudit-aggregator", metav1.GetOptions{})
	if err != nil || le.Spec.HolderIdentity == nil {
		t.Fatalf("the fleet Lease: %v", err)
	}
	return strings.TrimSuffix(*le.Spec.HolderIdentity, ":9443")
}

// checkPartials: each node is in its holder's partial, and in no other's.
func (l *live) checkPartials(t *testing.T, token string, holders map[string]string) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(500 * time.Millisecond) {
		var problems []string
		for _, ip := range l.replicas {
			code, body := l.internalGet(ip, "/internal/v1/partial", token)
			if code != http.StatusOK {
				problems = append(problems, fmt.Sprintf("%s: %d %s", ip, code, body))
				continue
			}
			var p aggregator.PartialResponse
			if err := json.Unmarshal(body, &p); err != nil {
				t.Fatalf("%s's partial: %v", ip, err)
			}
			if len(p.Partial.Nodes) > 0 {
				t.Logf("%s's partial: shards %v, %d nodes, %d bytes (%d a node)", ip, p.Shards, len(p.Partial.Nodes), len(body), len(body)/len(p.Partial.Nodes))
			}
			for _, s := range l.specs {
				in := slices.ContainsFunc(p.Partial.Nodes, func(n audit.NodeStatus) bool { return n.Node == s.Name })
				if mine := holders[s.Name] == ip+":9443"; in != mine {
					problems = append(problems, fmt.Sprintf("%s in %s's partial: %v, but its holder is %s", s.Name, ip, in, holders[s.Name]))
				}
			}
		}
		if len(problems) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("partials after 30 s:\n  %s", strings.Join(problems, "\n  "))
		}
	}
}

// streamsOpened counts each collector's streams so far (its log's lines).
func (l *live) streamsOpened() map[string]int {
	out := map[string]int{}
	for name, p := range l.cols {
		b, _ := os.ReadFile(p.Log)
		out[name] = strings.Count(string(b), "streaming to the aggregator")
	}
	return out
}

// nodeWatch samples the fleet's verdict until stopped: any finding, or
// any of its nodes not in sync or last heard more than three intervals
// before, is written down.
type nodeWatch struct {
	stopc chan struct{}
	done  chan struct{}
	mu    sync.Mutex
	bad   []string
}

func (l *live) watchNodes(nodes []string) *nodeWatch {
	w := &nodeWatch{stopc: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		for {
			select {
			case <-w.stopc:
				return
			case <-time.After(500 * time.Millisecond):
			}
			var nr struct {
				At    time.Time
				Nodes []audit.NodeStatus
			}
			if err := l.get("/api/v1/nodes", &nr); err != nil {
				continue // a replica gone: the others answer next time
			}
			fs, _ := l.findings()
			w.mu.Lock()
			if len(fs) > 0 {
				w.bad = append(w.bad, "findings: "+findings.Describe(fs))
			}
			for _, n := range nr.Nodes {
				if !slices.Contains(nodes, n.Node) {
					continue
				}
				if n.State != audit.NodeInSync || nr.At.Sub(n.LastReport) > 3*interval {
					w.bad = append(w.bad, fmt.Sprintf("%s %s, last report %s before the verdict", n.Node, n.State, nr.At.Sub(n.LastReport).Round(100*time.Millisecond)))
				}
			}
			w.mu.Unlock()
		}
	}()
	return w
}

func (w *nodeWatch) stop() string {
	close(w.stopc)
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.bad) > 5 {
		w.bad = append(w.bad[:5], fmt.Sprintf("… and %d more", len(w.bad)-5))
	}
	return strings.Join(w.bad, "; ")
}
