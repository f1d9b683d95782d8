package fleetsim_test

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/proxyaudit/proxyaudit/internal/api"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/fleetsim"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/shard"
	"github.com/proxyaudit/proxyaudit/internal/synth"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

func TestMain(m *testing.M) { localcluster.Main(m) }

// The defaults are the small fleet `make test` runs; `make fleet-sim` sets
// the anchors (see docs/benchmarks.md).
var (
	fleetNodes    = flag.Int("fleet-nodes", 60, "simulated nodes")
	fleetServices = flag.Int("fleet-services", 1000, "services (10 endpoints each)")
	fleetChurn    = flag.Float64("fleet-churn", 100, "endpoint changes per second")
	fleetInterval = flag.Duration("fleet-interval", 2*time.Second, "collector report interval")
	fleetSteady   = flag.Duration("fleet-steady", 30*time.Second, "churn window measured without faults")
	fleetRounds   = flag.Int("fleet-rounds", 2, "rounds of stuck nodes")
	fleetReport   = flag.String("fleet-report", "", "append the result as one JSON line to this file")
	fleetRefs     = flag.String("fleet-refs", "half", "which nodes name changed frontends by hash: all, none, or half (every other node, measured side by side)")
	fleetTops     = flag.Bool("fleet-tops", true, "nodes that name frontends by hash also name their whole state by its top, as collectors do (false: frontends only, as collectors before tops)")
	fleetAgg      = flag.String("fleet-aggregator", "", "aggregator binary to run (default: built from this tree), e.g. an older build to compare")
	fleetAggArgs  = flag.String("fleet-aggregator-args", "", "more flags for every aggregator replica, space-separated (e.g. --token-review-qps=400)")
	fleetAuth     = flag.Bool("fleet-auth", true, "authenticate every simulated collector by a real TokenReview (a token bound to a pod of the collector DaemonSet on its node); false: --insecure-no-auth")
	fleetReplicas = flag.Int("fleet-replicas", 2, "aggregator replicas (leader election on; 1 with -fleet-kill=false runs one without election)")
	fleetKill     = flag.Bool("fleet-kill", true, "SIGKILL the leader (with -fleet-shards, a replica that does not lead) mid-run and measure how soon its nodes are heard again")
	fleetShards   = flag.Int("fleet-shards", 0, "shards the replicas share the nodes in (--shards; 0: the leader takes every stream); needs -fleet-replicas of at least 2")
	fleetReplace  = flag.Int("fleet-replacements", 120, "nodes replaced (deleted, a new one joins) after the stuck rounds, in two halves: the leader's heap after each must not grow")
	fleetReplRate = flag.Float64("fleet-replacement-rate", 4, "node replacements a second")
)

const grace = 10 * time.Second

func nodeName(i int) string { return fmt.Sprintf("sim-%05d", i) }

// Result is one fleet simulation's measurements.
type Result struct {
	Aggregator                 string `json:",omitempty"`
	Nodes, Services, Endpoints int
	ChurnPerSecond             float64 // achieved
	IntervalSeconds            float64
	GraceSeconds               float64

	AggregatorRSSMB, AggregatorPeakRSSMB float64
	AggregatorCPUCores                   float64 // during the churn window
	IngestBytesPerSecondQuiet            float64 // no changes: root digests only
	IngestBytesPerSecondChurn            float64
	BytesPerNodePerIntervalQuiet         float64
	BytesPerNodePerIntervalChurn         float64
	// With -fleet-refs half, the two halves of one run side by side.
	Refs                                string
	Tops                                bool
	BytesPerNodePerIntervalChurnRefs    float64 `json:",omitempty"`
	BytesPerNodePerIntervalChurnContent float64 `json:",omitempty"`
	Wants                               int64
	InitialSyncSeconds                  float64 // every node in sync after the fleet connected

	DetectionSamples           int
	DetectionP50, DetectionP99 float64 // seconds after grace
	DetectionMax               float64
	FalseFindings              int
	Resyncs                    int64
	ReadNows                   int64    // read-now requests the aggregator sent
	WriteBlockedMaxSeconds     float64  // longest a report waited to be read
	TruthMaxLagSeconds         float64  // longest the simulated kube-proxies took to hold a change
	Missed                     []string `json:",omitempty"`
	FalseExamples              []string `json:",omitempty"`

	Auth     bool
	Replicas int
	// TLS: streams and the replicas' internal API over TLS (sharded runs
	// with authentication, as the chart runs them).
	TLS bool `json:",omitempty"`
	// With shards: every replica's RSS at the end and CPU in the churn
	// window (the leader's also in AggregatorRSSMB and
	// AggregatorCPUCores), by address; the nodes of the killed replica's
	// shards, and how many other nodes reconnected after the kill (0:
	// losing a replica moves only its shards).
	Shards                int                `json:",omitempty"`
	ReplicaRSSMB          map[string]float64 `json:",omitempty"`
	ReplicaCPUCores       map[string]float64 `json:",omitempty"`
	KilledReplicaNodes    int                `json:",omitempty"`
	UnmovedNodesReconnect int                `json:",omitempty"`
	// The leader's reads of the other replicas' partials before the
	// kill: how many, their bytes in full and as changes, and the bytes
	// per node read (the nodes the others hold taken as an even share).
	PartialReads, PartialReadBytesFull, PartialReadBytesChanges float64 `json:",omitempty"`
	PartialBytesPerNodeRead                                     float64 `json:",omitempty"`
	// After the leader's SIGKILL: how long until each node's first
	// report on a stream to the new leader, and the TokenReviews the API
	// server served meanwhile.
	ReconnectP50, ReconnectP99, ReconnectMax float64
	ReconnectTokenReviews                    float64
	// JudgingAgainSeconds: from the kill until the new leader's verdict
	// judged a report of every node made after it (the stuck round under
	// the new leader starts then: detection is measured on a leader that
	// has caught up; this is how long catching up took).
	JudgingAgainSeconds float64
	// Node replacements and the leader's live heap after each half.
	Replacements                    int
	HeapAfterHalfMB, HeapAfterAllMB float64
	Ghosts                          int // departed nodes the leader still listed
	// The leader's evaluation cycles (every second) over the run, before
	// the kill: how many, their mean, and how many took over 2 s (its
	// histogram's buckets): a slow cycle delays every finding.
	Evaluations, EvaluationsOver2s int
	EvaluationMeanSeconds          float64
	// The OpenReports ClusterReports' API writes, as the API server
	// counted them: per node per minute in the churn window without
	// faults, in all during the stuck rounds and per node stuck, the
	// highest rate over 10 s, and all over the run; the reports held at
	// the end, against the nodes with findings then.
	ReportWritesInitialSync            float64 // while the fleet connected (nodes not yet heard past the allowance are CollectorMissing)
	ReportWritesPerNodeMinuteChurn     float64
	ReportWritesStuckRounds            float64
	ReportWritesPerStuckNode           float64
	ReportWritesPeakPerSecond          float64
	ReportWritesTotal                  float64
	ReportsHeldAtEnd, ReportNodesAtEnd int
}

// TestE2EFleetSimulation runs the real aggregator binary against the real
// API server holding a synthetic cluster, with a fleet of simulated
// collectors speaking the stream protocol, endpoints churning, and rounds
// of stuck nodes (rules frozen, kube-proxy's syncs and health going on).
// It measures the aggregator and fails on any false finding or a stuck
// node not found.
func TestE2EFleetSimulation(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Hour)
	defer cancel()
	N, S := *fleetNodes, *fleetServices
	spec := synth.Spec{Services: S, EndpointsPerService: 10}
	res := Result{Aggregator: *fleetAgg, Nodes: N, Services: S, Endpoints: S * 10, IntervalSeconds: fleetInterval.Seconds(), GraceSeconds: grace.Seconds()}

	cfg := *c.RESTConfig
	cfg.QPS, cfg.Burst = 2000, 4000
	client, err := kubernetes.NewForConfig(&cfg)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	sl, err := fleetsim.Populate(ctx, client, spec, N, nodeName, 32)
	if err != nil {
		t.Fatalf("populate: %v", err)
	}
	t.Logf("created %d nodes, %d services, %d endpoint slices in %s", N, S, len(sl), time.Since(start).Round(time.Second))

	installReportsCRD(ctx, t, c)
	sctx, sstop := context.WithCancel(ctx)
	defer sstop()
	reportW := sampleReportWrites(sctx, client, 5*time.Second)
	writesNow := func() float64 {
		n, err := apiReportWrites(ctx, client)
		if err != nil {
			t.Logf("the API server's write count: %v", err)
		}
		return n
	}

	truth := fleetsim.NewTruth(client, time.Minute)
	truth.Run(ctx, time.Second)
	if truth.Latest() == nil {
		t.Fatal("the simulated kube-proxies never listed the cluster")
	}

	aggBin := *fleetAgg
	if aggBin == "" {
		bin := t.TempDir()
		if err := localcluster.BuildProxyaudit(bin); err != nil {
			t.Fatal(err)
		}
		aggBin = filepath.Join(bin, "proxyaudit-aggregator")
	}
	res.Auth, res.Replicas = *fleetAuth, *fleetReplicas
	setupIdentity(ctx, t, c)
	names := make([]string, N)
	for i := range names {
		names[i] = nodeName(i)
	}
	var toks []string
	if *fleetAuth {
		start := time.Now()
		if toks, err = tokens(ctx, c, names, 32); err != nil {
			t.Fatal(err)
		}
		t.Logf("%d collector pods and tokens in %s", N, time.Since(start).Round(time.Second))
	}
	args := []string{"--grace=" + grace.String(), "--leader-elect-namespace=" + fleetNS}
	// Sharded replicas run as the chart runs them: as one ServiceAccount,
	// streams and their internal API over TLS (they refuse to share the
	// fleet without it).
	sharedTLS := *fleetShards > 0 && *fleetAuth
	if sharedTLS {
		args = append(args, setupTLSReplicas(ctx, t, c)...)
	} else {
		args = append(args, "--kubeconfig="+c.AdminKubeconfig)
	}
	res.TLS = sharedTLS
	if *fleetAuth {
		args = append(args, "--collector-service-accounts="+fleetNS+"/"+collectorName, "--collector-daemonset="+fleetNS+"/"+collectorName, "--token-audience="+audience)
	} else {
		args = append(args, "--insecure-no-auth")
	}
	args = append(args, strings.Fields(*fleetAggArgs)...)
	if *fleetReplicas == 1 && !*fleetKill {
		args = append(args, "--leader-elect=false")
	}
	if res.Shards = *fleetShards; res.Shards > 0 {
		args = append(args, fmt.Sprintf("--shards=%d", res.Shards))
	}
	reps := startReplicas(t, c, aggBin, *fleetReplicas, args...)
	defer reps.stop()
	leader := reps.waitLeader(ctx, 5*time.Minute)
	agg := reps.procs[leader]
	aggAPI := reps.api(leader)

	fleet := fleetsim.NewFleet(truth, reps.streams(), N, nodeName, *fleetInterval, 300*time.Millisecond, 2*time.Second)
	if sharedTLS {
		fleet.TLS = streamTLS(ctx, t, c)
	}
	for i, tok := range toks {
		fleet.SetToken(i, tok)
	}
	res.Refs, res.Tops = *fleetRefs, *fleetTops
	refsNodes := 0
	switch *fleetRefs {
	case "all":
		fleet.UseRefs(func(int) bool { return true }, *fleetTops)
		refsNodes = N
	case "half":
		fleet.UseRefs(func(i int) bool { return i%2 == 1 }, *fleetTops)
		refsNodes = N / 2
	case "none":
	default:
		t.Fatalf("-fleet-refs %q: want all, none or half", *fleetRefs)
	}
	fctx, fstop := context.WithCancel(ctx)
	fdone := make(chan struct{})
	ramp := time.Duration(N) * 20 * time.Millisecond
	go func() { defer close(fdone); fleet.Run(fctx, ramp) }()
	defer func() { fstop(); <-fdone }()

	connected := time.Now()
	testkit.Eventually(t, 10*time.Minute+ramp, "every simulated node in sync", func() bool {
		v, err := aggAPI.verdict()
		return err == nil && len(v.Findings) == 0 && countState(v.Nodes, audit.NodeInSync) == N
	})
	res.InitialSyncSeconds = time.Since(connected).Seconds()
	res.ReportWritesInitialSync = writesNow()
	t.Logf("%d nodes in sync %.1f s after the fleet started connecting (ramp-up %s)", N, res.InitialSyncSeconds, ramp)

	// Quiet: no changes, every report is a root digest.
	b0, a0 := fleet.BytesSent.Load(), time.Now()
	time.Sleep(3 * *fleetInterval)
	res.IngestBytesPerSecondQuiet = float64(fleet.BytesSent.Load()-b0) / time.Since(a0).Seconds()
	res.BytesPerNodePerIntervalQuiet = res.IngestBytesPerSecondQuiet / float64(N) * fleetInterval.Seconds()

	churn := &fleetsim.Churn{}
	cctx, cstop := context.WithCancel(ctx)
	cdone := make(chan struct{})
	go func() { defer close(cdone); churn.Run(cctx, client, spec, sl, *fleetChurn) }()
	defer func() { cstop(); <-cdone }()

	// The verdict is polled throughout: a finding on a node not stuck is
	// false. A stuck node's findings are true until it is back in sync.
	stuck := map[string]time.Time{} // node → frozen at
	falseSeen := map[string]bool{}
	// What the leader's verdict does over time: a view that goes stale
	// judges nothing, and a verdict that stops moving delays detection.
	var lastAt, movedAt time.Time
	wasStale := false
	// Findings are read on every look; the node list (megabytes at 5,000
	// nodes, encoded by the leader on the same cores) only when asked for.
	check := func(nodes bool) audit.Verdict {
		v, stale, err := aggAPI.verdictStale(nodes)
		if err != nil {
			t.Logf("verdict: %v", err)
			return v
		}
		now := time.Now()
		switch {
		case stale != nil && !wasStale:
			t.Logf("the leader's view is stale since %s: %s", stale.Since.Format("15:04:05.000"), stale.Reason)
		case stale == nil && wasStale:
			t.Logf("the leader's view is fresh again")
		}
		wasStale = stale != nil
		if !v.At.Equal(lastAt) {
			if !movedAt.IsZero() && now.Sub(movedAt) > 5*time.Second {
				t.Logf("the leader's verdict did not move for %s (until %s)", now.Sub(movedAt).Round(100*time.Millisecond), v.At.Format("15:04:05.000"))
			}
			lastAt, movedAt = v.At, now
		}
		for _, f := range v.Findings {
			if _, ok := stuck[f.Node]; ok {
				continue
			}
			k := fmt.Sprintf("%s %s %s %s (%s)", f.Node, f.Kind, f.Service, f.Endpoint, f.Detail)
			if !falseSeen[k] {
				falseSeen[k] = true
				res.FalseFindings++
				if len(res.FalseExamples) < 10 {
					res.FalseExamples = append(res.FalseExamples, k)
				}
				t.Errorf("false finding: %s", k)
				if res.FalseFindings <= 3 && f.Endpoint != "" {
					diagnose(t, ctx, client, aggAPI, truth, fleet, f)
				}
			}
		}
		return v
	}

	time.Sleep(2 * *fleetInterval) // the first changes reach every node
	agg0, err := localcluster.ReadProcStat(agg.PID())
	if err != nil {
		t.Fatal(err)
	}
	reps0 := reps.stats()
	b0, a0, m0, r0 := fleet.BytesSent.Load(), time.Now(), churn.Made.Load(), fleet.BytesSentRefs.Load()
	rw0 := writesNow()
	for time.Since(a0) < *fleetSteady {
		check(false)
		time.Sleep(500 * time.Millisecond)
	}
	agg1, err := localcluster.ReadProcStat(agg.PID())
	if err != nil {
		t.Fatal(err)
	}
	wall := time.Since(a0).Seconds()
	res.ReportWritesPerNodeMinuteChurn = (writesNow() - rw0) / float64(N) / (wall / 60)
	res.ChurnPerSecond = float64(churn.Made.Load()-m0) / wall
	res.AggregatorCPUCores = (agg1.CPU - agg0.CPU).Seconds() / wall
	if res.Shards > 0 {
		res.ReplicaCPUCores = map[string]float64{}
		for ip, st := range reps.stats() {
			res.ReplicaCPUCores[ip] = (st.CPU - reps0[ip].CPU).Seconds() / wall
		}
		t.Logf("replicas' CPU under churn (cores): %v", res.ReplicaCPUCores)
	}
	res.IngestBytesPerSecondChurn = float64(fleet.BytesSent.Load()-b0) / wall
	res.BytesPerNodePerIntervalChurn = res.IngestBytesPerSecondChurn / float64(N) * fleetInterval.Seconds()
	perNode := func(bytes int64, nodes int) float64 {
		return float64(bytes) / wall / float64(nodes) * fleetInterval.Seconds()
	}
	if refsNodes > 0 {
		res.BytesPerNodePerIntervalChurnRefs = perNode(fleet.BytesSentRefs.Load()-r0, refsNodes)
	}
	if refsNodes < N {
		res.BytesPerNodePerIntervalChurnContent = perNode(fleet.BytesSent.Load()-b0-(fleet.BytesSentRefs.Load()-r0), N-refsNodes)
	}
	t.Logf("per node per interval under churn: %.0f B naming by hash (tops: %v), %.0f B sending content",
		res.BytesPerNodePerIntervalChurnRefs, *fleetTops, res.BytesPerNodePerIntervalChurnContent)
	t.Logf("churn %.0f/s (%d failed): aggregator %.2f cores, ingest %.0f B/s (%.0f B per node per interval)",
		res.ChurnPerSecond, churn.Failed.Load(), res.AggregatorCPUCores, res.IngestBytesPerSecondChurn, res.BytesPerNodePerIntervalChurn)

	// Rounds of stuck nodes: 1% of the fleet (at least 3) at once, far
	// below mass divergence.
	k := max(3, N/100)
	var lat []float64
	stuckRound := func(round int) {
		var idx []int
		for j := range k {
			idx = append(idx, (round*k+j)*7919%N)
		}
		frozen := map[string]uint64{}
		for _, i := range idx {
			v := fleet.Freeze(i)
			stuck[fleet.Name(i)] = time.Now()
			frozen[fleet.Name(i)] = v.Seq
		}
		found := map[string]time.Time{}
		// What the leader said of each stuck node while it was looked for:
		// for a slow detection, the reports it judged and when.
		trace, last := map[string][]string{}, map[string]string{}
		deadline := time.Now().Add(grace + 3**fleetInterval + 60*time.Second)
		// The trace is read beside the findings, never in their way: 50
		// requests in a row take seconds on a busy box.
		var traceMu sync.Mutex
		tctx, tstop := context.WithCancel(ctx)
		tdone := make(chan struct{})
		go func() {
			defer close(tdone)
			for tctx.Err() == nil {
				for name := range frozen {
					traceMu.Lock()
					done := !found[name].IsZero()
					traceMu.Unlock()
					if done {
						continue
					}
					s, err := aggAPI.node(name)
					if err != nil {
						continue
					}
					line := fmt.Sprintf("%s last report %s watermark %s", s.State, s.LastReport.Format("15:04:05.000"), s.Watermark.Format("15:04:05.000"))
					traceMu.Lock()
					if line != last[name] {
						last[name] = line
						trace[name] = append(trace[name], time.Now().Format("15:04:05.000")+" "+line)
					}
					traceMu.Unlock()
				}
				select {
				case <-tctx.Done():
				case <-time.After(time.Second):
				}
			}
		}()
		for len(found) < len(idx) && time.Now().Before(deadline) {
			v := check(false)
			now := time.Now()
			traceMu.Lock()
			for _, f := range v.Findings {
				if _, ok := frozen[f.Node]; !ok {
					continue
				}
				// Found when the leader first published any finding of
				// the node (same machine, same clock), not when a poll
				// saw it.
				at := f.Found
				if at.IsZero() {
					at = v.At
				}
				if was := found[f.Node]; was.IsZero() || at.Before(was) {
					found[f.Node] = at
					trace[f.Node] = append(trace[f.Node], fmt.Sprintf("%s seen: found by the leader at %s", now.Format("15:04:05.000"), at.Format("15:04:05.000")))
				}
			}
			traceMu.Unlock()
			time.Sleep(250 * time.Millisecond)
		}
		tstop()
		<-tdone
		for name, seq := range frozen {
			missed := truth.After(seq)
			if found[name].IsZero() || missed == nil {
				res.Missed = append(res.Missed, name)
				t.Errorf("round %d: stuck node %s not reported within %s of its first missed change", round, name, grace+3**fleetInterval+60*time.Second)
				continue
			}
			l := found[name].Sub(missed.At.Add(grace)).Seconds()
			lat = append(lat, l)
			t.Logf("round %d: %s stuck at version %d, first missed change at %s, found %.1f s after grace",
				round, name, seq, missed.At.Format("15:04:05.000"), l)
			// A report is due every interval, and read-now asks for one as
			// the change crosses grace: later than that is a bug (a stuck
			// node's reports once went unjudged for up to 45 s).
			if late := max(5*time.Second, 2**fleetInterval) + 5*time.Second; l > late.Seconds() {
				t.Errorf("round %d: %s found %.1f s after grace, more than %s; as the leader showed it:\n    %s", round, name, l, late, strings.Join(trace[name], "\n    "))
			} else if l > 5 {
				t.Logf("  %s as the leader showed it:\n    %s", name, strings.Join(trace[name], "\n    "))
			}
		}
		for _, i := range idx {
			fleet.Thaw(i)
		}
		// Thawed nodes catch up; their findings must clear.
		testkit.Eventually(t, grace+4**fleetInterval+30*time.Second, "thawed nodes back in sync", func() bool {
			v := check(false)
			for _, f := range v.Findings {
				if _, ok := frozen[f.Node]; ok {
					return false
				}
			}
			return true
		})
		for name := range frozen {
			delete(stuck, name)
		}
	}
	rw1 := writesNow()
	for round := range *fleetRounds {
		stuckRound(round)
	}
	res.ReportWritesStuckRounds = writesNow() - rw1
	res.ReportWritesPerStuckNode = res.ReportWritesStuckRounds / float64(k**fleetRounds)
	if h, err := aggAPI.evaluations(); err != nil {
		t.Logf("the leader's evaluation durations: %v", err)
	} else {
		res.Evaluations, res.EvaluationsOver2s, res.EvaluationMeanSeconds = h.count, h.over2s, h.mean
		t.Logf("the leader's evaluations: %d, mean %.3f s, %d over 2 s", h.count, h.mean, h.over2s)
		if res.Shards > 0 && h.partialReads > 0 {
			res.PartialReads, res.PartialReadBytesFull, res.PartialReadBytesChanges = h.partialReads, h.partialBytes["full"], h.partialBytes["changes"]
			res.PartialBytesPerNodeRead = (h.partialBytes["full"] + h.partialBytes["changes"]) / h.partialReads / (float64(N) * float64(*fleetReplicas-1) / float64(*fleetReplicas))
			t.Logf("the leader read %.0f partials: %.1f MB in full, %.1f MB of changes; %.1f bytes per node per read", h.partialReads, h.partialBytes["full"]/1e6, h.partialBytes["changes"]/1e6, res.PartialBytesPerNodeRead)
		}
	}

	if *fleetKill && res.Shards > 0 {
		killShardHolder(ctx, t, reps, fleet, leader, &res, check)
		// The new holders judging the moved nodes again, and the killed
		// replica back (as its Deployment would bring it): it takes a
		// share of the shards, whose nodes move to it, with no false
		// finding.
		killedAt := time.Now()
		testkit.Eventually(t, 3*time.Minute, "the fleet judged again after the killed replica rejoined", func() bool {
			// Under churn a node is rarely in sync at any one moment: a
			// report judged after the rejoin is the measure, as for a
			// leader's kill; a false finding fails the run in check.
			return allJudgedAfter(check(true).Nodes, N, killedAt)
		})
		res.JudgingAgainSeconds = time.Since(killedAt).Seconds()
		t.Logf("every node judged again %.1f s after the killed replica rejoined (taking back a share of the shards)", res.JudgingAgainSeconds)
		stuckRound(*fleetRounds)
	} else if *fleetKill {
		// The leader SIGKILLed under churn: the fleet must be heard by
		// the new leader soon, each collector reviewed once at most.
		reviews0, err := tokenReviews(ctx, client)
		if err != nil {
			t.Fatal(err)
		}
		killed := leader
		killedAt := time.Now()
		agg.Kill()
		t.Logf("leader %s SIGKILLed", killed)
		testkit.Eventually(t, 5*time.Minute, "every node heard by the new leader", func() bool {
			return len(fleet.Heard(killedAt)) == N
		})
		heard := fleet.Heard(killedAt)
		reviews1, err := tokenReviews(ctx, client)
		if err != nil {
			t.Fatal(err)
		}
		leader = reps.waitLeader(ctx, time.Minute)
		agg, aggAPI = reps.procs[leader], reps.api(leader)
		slices.Sort(heard)
		res.ReconnectP50, res.ReconnectP99, res.ReconnectMax = heard[len(heard)/2].Seconds(), heard[min(len(heard)-1, len(heard)*99/100)].Seconds(), heard[len(heard)-1].Seconds()
		res.ReconnectTokenReviews = reviews1 - reviews0
		t.Logf("fleet heard again by %s after the kill: p50 %.1f s, p99 %.1f s, max %.1f s; %0.f TokenReviews for %d collectors",
			leader, res.ReconnectP50, res.ReconnectP99, res.ReconnectMax, res.ReconnectTokenReviews, N)
		// The goal at 5,000 nodes is 30 s, lease expiry included; a
		// smaller fleet must do at least as well.
		if res.ReconnectP99 > 30 {
			t.Errorf("p99 of the fleet heard again %.1f s after the leader's kill, want ≤ 30 s", res.ReconnectP99)
		}
		if *fleetAuth && res.ReconnectTokenReviews > float64(N) {
			t.Errorf("%0.f TokenReviews to hear %d collectors again, want at most one each", res.ReconnectTokenReviews, N)
		}
		reps.start(killed) // as its Deployment would; it follows
		// The new leader judging the whole fleet again: every node's
		// last judged report made after the kill.
		testkit.Eventually(t, 3*time.Minute, "the new leader judging every node again", func() bool {
			v, err := aggAPI.verdict()
			return err == nil && allJudgedAfter(v.Nodes, N, killedAt)
		})
		res.JudgingAgainSeconds = time.Since(killedAt).Seconds()
		t.Logf("the new leader judged every node again %.1f s after the kill", res.JudgingAgainSeconds)
		// Detection goes on under the new leader.
		stuckRound(*fleetRounds)
	}

	if R := *fleetReplace; R > 0 {
		replaceNodes(ctx, t, c, client, fleet, reps, leader, &res, N, R, *fleetReplRate, check)
	}
	slices.Sort(lat)
	res.DetectionSamples = len(lat)
	if len(lat) > 0 {
		res.DetectionP50 = lat[len(lat)/2]
		res.DetectionP99 = lat[min(len(lat)-1, len(lat)*99/100)]
		res.DetectionMax = lat[len(lat)-1]
	}
	end, err := localcluster.ReadProcStat(agg.PID())
	if err != nil {
		t.Fatal(err)
	}
	res.AggregatorRSSMB, res.AggregatorPeakRSSMB = float64(end.RSS)/1e6, float64(end.PeakRSS)/1e6
	if res.Shards > 0 {
		res.ReplicaRSSMB = map[string]float64{}
		for ip, st := range reps.stats() {
			res.ReplicaRSSMB[ip] = float64(st.RSS) / 1e6
		}
		t.Logf("replicas' RSS at the end (MB): %v", res.ReplicaRSSMB)
	}
	res.Resyncs = fleet.Resyncs.Load()
	res.ReadNows = fleet.ReadNows.Load()
	res.Wants = fleet.Wants.Load()
	res.WriteBlockedMaxSeconds = time.Duration(fleet.WriteBlocked.Load()).Seconds()
	res.TruthMaxLagSeconds = truth.MaxLag().Seconds()
	checkReportsHeld(ctx, t, c, aggAPI, &res)
	sstop()
	res.ReportWritesTotal, res.ReportWritesPeakPerSecond = writesNow(), reportW.peak(10*time.Second)
	t.Logf("OpenReports writes: %.0f while the fleet connected, %.3f per node per minute under churn, %.0f in the stuck rounds (%.1f per stuck node), peak %.1f/s over 10 s, %.0f in all; %d reports held at the end for %d nodes with findings",
		res.ReportWritesInitialSync, res.ReportWritesPerNodeMinuteChurn, res.ReportWritesStuckRounds, res.ReportWritesPerStuckNode, res.ReportWritesPeakPerSecond, res.ReportWritesTotal, res.ReportsHeldAtEnd, res.ReportNodesAtEnd)
	if res.ReportWritesPerNodeMinuteChurn > 1 || res.ReportWritesPeakPerSecond > 60 {
		t.Errorf("OpenReports writes over their bounds: %.3f per node per minute under churn (≤ 1), peak %.1f/s (≤ 60)", res.ReportWritesPerNodeMinuteChurn, res.ReportWritesPeakPerSecond)
	}
	if errs := fleet.LastErrors(); len(errs) > 0 {
		t.Logf("stream errors on %d nodes, e.g. %v", len(errs), first(errs))
	}
	if lim := grace - 2*time.Second; truth.MaxLag() > lim {
		t.Errorf("the simulated kube-proxies took up to %s to hold a change (more than %s): this machine could not keep them healthy, so their findings may be true; measure a smaller fleet", truth.MaxLag().Round(time.Millisecond), lim)
	}
	out, _ := json.Marshal(res)
	t.Logf("RESULT %s", out)
	if *fleetReport != "" {
		f, err := os.OpenFile(*fleetReport, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(f, "%s\n", out)
		f.Close()
	}
}

// diagnose logs, for a false finding, what the API server, the simulated
// kube-proxies' truth and the aggregator each say about the service.
func diagnose(t *testing.T, ctx context.Context, client kubernetes.Interface, agg *apiClient, truth *fleetsim.Truth, fleet *fleetsim.Fleet, f audit.TimedFinding) {
	ns, name, _ := strings.Cut(f.Service, "/")
	if sl, err := client.DiscoveryV1().EndpointSlices(ns).Get(ctx, name+"-0", metav1.GetOptions{}); err == nil {
		var addrs []string
		for _, e := range sl.Endpoints {
			addrs = append(addrs, e.Addresses...)
		}
		t.Logf("  API server: %s rv %s endpoints %v", sl.Name, sl.ResourceVersion, addrs)
	}
	if v := truth.Latest(); v != nil {
		t.Logf("  simulated kube-proxies' newest version %d (changes from %s)", v.Seq, v.At.Format("15:04:05.000"))
	}
	if v := fleet.Sent(f.Node); v != nil {
		var eps []string
		v.State.Keys(func(key string) {
			if fe, ok := v.State.Get(key); ok && fe.Name == "" {
				for _, e := range fe.Endpoints {
					if strings.HasPrefix(e, f.Endpoint) || (f.Endpoint != "" && strings.HasPrefix(f.Endpoint, strings.Split(e, ":")[0]+":")) {
						eps = append(eps, key+" "+strings.Join(fe.Endpoints, ","))
					}
				}
			}
		})
		t.Logf("  %s last sent version %d (changes from %s); frontends holding %s: %v", f.Node, v.Seq, v.At.Format("15:04:05.000"), f.Endpoint, eps)
	}
	var ex api.ExplainResponse
	if err := agg.get("/api/v1/nodes/"+f.Node+"/explain?service="+f.Service, &ex); err == nil {
		b, _ := json.Marshal(ex)
		t.Logf("  aggregator's explain: %.1500s", b)
	}
	var nr api.NodeResponse
	if err := agg.get("/api/v1/nodes/"+f.Node, &nr); err == nil {
		t.Logf("  aggregator on %s: state %s, last report %s, watermark %s, since %s, kube-proxy %+v", f.Node, nr.State,
			nr.LastReport.Format("15:04:05.000"), nr.Watermark.Format("15:04:05.000"), f.Since.Format("15:04:05.000"), nr.KubeProxy)
	}
}

func first(m map[string]string) string {
	for k, v := range m {
		return k + ": " + v
	}
	return ""
}

func countState(ns []audit.NodeStatus, s audit.NodeState) int {
	n := 0
	for _, x := range ns {
		if x.State == s {
			n++
		}
	}
	return n
}

type apiClient struct{ base string }

func (a *apiClient) ready() bool {
	r, err := http.Get(a.base + "/readyz")
	if err != nil {
		return false
	}
	r.Body.Close()
	return r.StatusCode == http.StatusOK
}

// verdict reads findings and nodes.
func (a *apiClient) verdict() (audit.Verdict, error) {
	v, _, err := a.verdictStale(true)
	return v, err
}

// verdictStale is the leader's findings, its nodes when asked for, and
// what it says of its view: stale (and why) while it judges nothing.
func (a *apiClient) verdictStale(nodes bool) (audit.Verdict, *api.StaleView, error) {
	var v audit.Verdict
	var fr api.FindingsResponse
	if err := a.get("/api/v1/findings", &fr); err != nil {
		return v, nil, err
	}
	v = audit.Verdict{At: fr.At, Findings: fr.Findings}
	if nodes {
		var nr api.NodesResponse
		if err := a.get("/api/v1/nodes", &nr); err != nil {
			return v, nil, err
		}
		v.Nodes = nr.Nodes
	}
	return v, fr.Stale, nil
}

type evaluations struct {
	count, over2s int
	mean          float64
	// Sharded: the leader's reads of the other replicas' partials, and
	// their bytes by kind (full, changes).
	partialReads float64
	partialBytes map[string]float64
}

// evaluations reads the leader's evaluation cycle durations from its
// /metrics (proxyaudit_reconcile_duration_seconds{phase="evaluate"}).
func (a *apiClient) evaluations() (evaluations, error) {
	var e evaluations
	r, err := http.Get(a.base + "/metrics")
	if err != nil {
		return e, err
	}
	defer r.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	mf, err := parser.TextToMetricFamilies(r.Body)
	if err != nil {
		return e, err
	}
	e.partialBytes = map[string]float64{}
	for _, m := range mf["proxyaudit_partial_read_bytes_total"].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "kind" {
				e.partialBytes[l.GetValue()] = m.GetCounter().GetValue()
			}
		}
	}
	for _, m := range mf["proxyaudit_partial_reads_total"].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "outcome" && l.GetValue() == "ok" {
				e.partialReads = m.GetCounter().GetValue()
			}
		}
	}
	f := mf["proxyaudit_reconcile_duration_seconds"]
	if f == nil {
		return e, fmt.Errorf("no proxyaudit_reconcile_duration_seconds in the leader's metrics")
	}
	for _, m := range f.GetMetric() {
		phase := ""
		for _, l := range m.GetLabel() {
			if l.GetName() == "phase" {
				phase = l.GetValue()
			}
		}
		h := m.GetHistogram()
		if phase != "evaluate" || h == nil {
			continue
		}
		e.count = int(h.GetSampleCount())
		if e.count > 0 {
			e.mean = h.GetSampleSum() / float64(e.count)
		}
		within := 0
		for _, b := range h.GetBucket() {
			if b.GetUpperBound() <= 2.048+1e-9 {
				within = int(b.GetCumulativeCount())
			}
		}
		e.over2s = e.count - within
		return e, nil
	}
	return e, fmt.Errorf("no evaluate phase in the leader's proxyaudit_reconcile_duration_seconds")
}

// node is what the leader says of one node.
func (a *apiClient) node(name string) (audit.NodeStatus, error) {
	var nr api.NodeResponse
	err := a.get("/api/v1/nodes/"+name, &nr)
	return nr.NodeStatus, err
}

func (a *apiClient) get(path string, v any) error {
	r, err := http.Get(a.base + path)
	if err != nil {
		return err
	}
	defer r.Body.Close()
	body, _ := io.ReadAll(r.Body)
	if r.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %s", path, r.Status, strings.TrimSpace(string(body)))
	}
	return json.Unmarshal(body, v)
}

// allJudgedAfter says whether a verdict holds the n nodes, each judged on
// a report made after at.
func allJudgedAfter(nodes []audit.NodeStatus, n int, at time.Time) bool {
	if len(nodes) < n {
		return false
	}
	for _, s := range nodes {
		if !s.LastReport.After(at) {
			return false
		}
	}
	return true
}

// killShardHolder SIGKILLs a replica holding shards that does not lead,
// under churn: the nodes of its shards must be heard again by their new
// holders (p99 ≤ 30 s, Lease expiry included), and no other node's stream
// may move. The verdict is checked for false findings throughout.
func killShardHolder(ctx context.Context, t *testing.T, reps *replicas, fleet *fleetsim.Fleet, leader string, res *Result, check func(bool) audit.Verdict) {
	var victim string
	for _, ip := range replicaIPs[:res.Replicas] {
		if ip != leader && len(reps.shardsOf(ctx, ip)) > 0 {
			victim = ip
			break
		}
	}
	if victim == "" {
		t.Fatalf("no replica but the leader (%s) holds a shard", leader)
	}
	held := reps.shardsOf(ctx, victim)
	moved := map[string]bool{}
	for i := range res.Nodes {
		if name := fleet.Name(i); held[shard.Of(name, res.Shards)] {
			moved[name] = true
		}
	}
	res.KilledReplicaNodes = len(moved)
	reviews0, err := tokenReviews(ctx, reps.c.Client)
	if err != nil {
		t.Fatal(err)
	}
	killedAt := time.Now()
	reps.procs[victim].Kill()
	t.Logf("replica %s SIGKILLed under churn, holding %d shards and %d nodes (the leader is %s)", victim, len(held), len(moved), leader)
	heardAgain := func() (in []time.Duration, out int) {
		for name, d := range fleet.Reconnected(killedAt) {
			if moved[name] {
				in = append(in, d)
			} else {
				out++
			}
		}
		return in, out
	}
	testkit.Eventually(t, 5*time.Minute, "the killed replica's nodes heard again", func() bool {
		check(false)
		in, _ := heardAgain()
		return len(in) == len(moved)
	})
	heard, others := heardAgain()
	slices.Sort(heard)
	res.ReconnectP50, res.ReconnectP99, res.ReconnectMax = heard[len(heard)/2].Seconds(), heard[min(len(heard)-1, len(heard)*99/100)].Seconds(), heard[len(heard)-1].Seconds()
	res.UnmovedNodesReconnect = others
	if reviews1, err := tokenReviews(ctx, reps.c.Client); err == nil {
		res.ReconnectTokenReviews = reviews1 - reviews0
	}
	t.Logf("the killed replica's %d nodes heard again by their new holders: p50 %.1f s, p99 %.1f s, max %.1f s; %d other nodes reconnected; %.0f TokenReviews",
		len(moved), res.ReconnectP50, res.ReconnectP99, res.ReconnectMax, others, res.ReconnectTokenReviews)
	if res.ReconnectP99 > 30 {
		t.Errorf("p99 of the killed replica's nodes heard again %.1f s after the kill, want ≤ 30 s", res.ReconnectP99)
	}
	if others > 0 {
		t.Errorf("%d nodes of shards the killed replica did not hold reconnected: losing a replica must move only its shards", others)
	}
	reps.start(victim)
}
