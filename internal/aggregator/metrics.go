package aggregator

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/proxyaudit/proxyaudit/internal/buildinfo"

	"github.com/proxyaudit/proxyaudit/audit"
)

// Metrics are the aggregator's Prometheus metrics, all in one place. No
// label carries an IP address; node names bound the cardinality.
type Metrics struct {
	Registry *prometheus.Registry

	Findings       *prometheus.GaugeVec
	Nodes          *prometheus.GaugeVec
	ProgrammingLag prometheus.Histogram
	FindingDelay   *prometheus.HistogramVec
	NoRulesSeen    *prometheus.CounterVec

	StreamMessages *prometheus.CounterVec
	StreamBytes    *prometheus.CounterVec
	StreamRejected *prometheus.CounterVec
	Streams        prometheus.Gauge
	ReportsWaiting prometheus.Gauge
	ReportBytes    prometheus.Histogram
	Resyncs        prometheus.Counter
	Refs           *prometheus.CounterVec
	Named          *prometheus.CounterVec
	ReadNow        prometheus.Counter
	// What the collectors say their reads cost, over the fleet.
	CollectorReads       *prometheus.CounterVec
	CollectorFallbacks   prometheus.Counter
	CollectorReadSeconds prometheus.Histogram
	CollectorReadBytes   prometheus.Histogram
	HTTPDenied           *prometheus.CounterVec

	Reconcile   *prometheus.HistogramVec
	Assessments *prometheus.CounterVec
	// ServiceAssessments counts services reassessed within incremental
	// node assessments, by whether another node's result was shared.
	ServiceAssessments *prometheus.CounterVec
	Leader             prometheus.Gauge
	// Sharded replicas (issue #41).
	ShardsHeld, ShardsUnheard prometheus.Gauge
	PartialReads              *prometheus.CounterVec
	PartialReadBytes          *prometheus.CounterVec
	ViewStale                 prometheus.Gauge
	Actions                   *prometheus.CounterVec
	ReportWrites              *prometheus.CounterVec
	Slack                     *prometheus.CounterVec
	// Held is 1 while every repair is held, by why: paused, window.
	Held *prometheus.GaugeVec
	// HeldDecisions counts pages instead of repairs by what held them.
	HeldDecisions *prometheus.CounterVec
	// Alertmanager counts calls to Alertmanager by operation and outcome.
	Alertmanager *prometheus.CounterVec
}

// NewMetrics registers the aggregator's metrics (and the Go and process
// collectors) in a fresh registry.
func NewMetrics() *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		Findings: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "proxyaudit_findings", Help: "Current findings by kind (after grace)."}, []string{"kind"}),
		Nodes: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "proxyaudit_nodes", Help: "Nodes by state: InSync, Lagging, Divergent, Stuck, NoRules, Missing, Pending."}, []string{"state"}),
		// Fleet-wide: one series per bucket, not per node (13 × 5,000
		// series at the scalability anchors). Each node's own p50/p90/p99
		// is in GET /api/v1/nodes.
		ProgrammingLag: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "proxyaudit_programming_lag_seconds",
			Help:    "Time from a Service or EndpointSlice change until a node's reported rules showed it, over every node (upper bound at the collector's interval); per node in GET /api/v1/nodes.",
			Buckets: []float64{0.5, 1, 2, 5, 10, 15, 20, 30, 60, 120, 300}}),
		FindingDelay: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "proxyaudit_finding_delay_seconds",
			Help:    "Time from when a finding's condition began (its since) until the leader first reported it, by kind: the grace period plus detection (\"found\" per finding in GET /api/v1/findings).",
			Buckets: []float64{1, 2, 5, 10, 15, 20, 25, 30, 35, 40, 45, 60, 90, 120, 300, 600}}, []string{"kind"}),
		NoRulesSeen: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_no_rules_observed_total", Help: "Times a node was seen without any kube-proxy rules (a flush), whether or not it lasted past grace."}, []string{"node"}),
		StreamMessages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_stream_messages_total", Help: "Stream messages by direction (in, out) and type."}, []string{"direction", "type"}),
		StreamBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_stream_bytes_total", Help: "Stream bytes by direction (in, out)."}, []string{"direction"}),
		StreamRejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_stream_rejected_total", Help: "Streams refused or cut, by reason: auth, busy (the token-review budget is spent; the collector retries), unauthenticated_limit (too many connections not past their hello, overall or from one address; closed unread), too_large, malformed, protocol, invalid_report, replay, rate, timeout."}, []string{"reason"}),
		Streams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "proxyaudit_streams", Help: "Collector streams currently open on this replica."}),
		ReportsWaiting: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "proxyaudit_stream_reports_waiting", Help: "Reports whose bytes wait in their sockets for the decode budget: above a few for long, the leader is behind its fleet (its collectors are alive, not silent)."}),
		ReportBytes: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "proxyaudit_report_bytes", Help: "Size of collector reports: a root digest when steady, deltas under churn, snapshots on resync.",
			Buckets: prometheus.ExponentialBuckets(64, 4, 10)}),
		Resyncs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "proxyaudit_stream_resyncs_total", Help: "Full resyncs requested because a collector's digest differed from the aggregator's copy."}),
		Refs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_stream_refs_total", Help: "Frontends collectors named by content hash instead of sending them, by outcome: known (some node's copy held that content), wanted (asked of the collector)."}, []string{"outcome"}),
		Named: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_stream_named_total", Help: "States (level top) and buckets (level bucket) collectors named by hash instead of sending their changes, by outcome: known (some node's copy held the state; counted for tops only), wanted (the collector was asked one level down)."}, []string{"level", "outcome"}),
		HTTPDenied: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_http_denied_total", Help: "HTTP API requests refused: no_token, unauthenticated, forbidden, review_failed (the API server could not be asked), busy (the readers' review budget is spent)."}, []string{"reason"}),
		ReadNow: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "proxyaudit_stream_read_now_total", Help: "Immediate reads asked of collectors whose lag was crossing the grace period before their next report."}),
		CollectorReads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_collector_reads_total",
			Help: "Reads of kube-proxy's rules the collectors report, over the fleet, by reason: change (the kernel's change signal moved), backstop (the full-read interval), read-now (asked by the aggregator), resync (a new stream or a resync with nothing read yet), heartbeat (a source without a change signal: IPVS)."}, []string{"reason"}),
		CollectorFallbacks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "proxyaudit_collector_read_fallbacks_total",
			Help: "Reads the collectors had to take from the text tool (iptables-save) because their kernel reader could not decode a rule, over the fleet; which node and why in GET /api/v1/nodes and proxyaudit explain node."}),
		CollectorReadSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "proxyaudit_collector_read_duration_seconds", Help: "Wall time of the collectors' reads of the rules, over the fleet; each node's last one in GET /api/v1/nodes.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 9)}),
		CollectorReadBytes: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "proxyaudit_collector_read_bytes", Help: "Bytes the collectors' reads of the rules took in (the dump tool's output, or netlink), over the fleet.",
			Buckets: prometheus.ExponentialBuckets(1024, 4, 10)}),
		Reconcile: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "proxyaudit_reconcile_duration_seconds", Help: "Duration of reconciliation phases: cluster_state (rebuild from informers), assess (one node), evaluate (the fleet), remediate (one remediation round, beside the evaluations).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 4, 10)}, []string{"phase"}),
		Assessments: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_assessments_total", Help: "Node assessments by how they were made: computed (in full), shared (another node of the same class showed the very same rules at the same cluster state), incremental (only the services that changed since the node's last one), peer (from another node's last one: only the services that differ between the two)."}, []string{"how"}),
		ServiceAssessments: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_service_assessments_total", Help: "Services reassessed within incremental and peer node assessments: computed, or shared (another node showing the same frontends for the service, expecting the same of it, was assessed at the same cluster state)."}, []string{"how"}),
		Leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "proxyaudit_leader", Help: "1 when this replica leads (judges and accepts streams)."}),
		ShardsHeld: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "proxyaudit_shards_held", Help: "The shards this replica holds: it takes their nodes' streams and judges them (sharded replicas, --shards)."}),
		ShardsUnheard: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "proxyaudit_shards_unheard", Help: "On the leader of sharded replicas: shards whose holder's partial verdict could not be read for 10 s, or that nobody holds; their nodes are missing from the findings and node list."}),
		PartialReads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_partial_reads_total", Help: "The leader's reads of the other replicas' partial verdicts (sharded replicas), by outcome (ok, failed)."}, []string{"outcome"}),
		PartialReadBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_partial_read_bytes_total", Help: "Bytes of the other replicas' partial verdicts the leader read (sharded replicas), by kind: full (every node), changes (what changed since the leader's last read)."}, []string{"kind"}),
		ViewStale: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "proxyaudit_view_stale", Help: "1 while the leader's view of the API is stale (a watch failing, or its Lease renewals not seen): nothing is judged or repaired."}),
		ReportWrites: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_openreports_writes_total", Help: "API writes of the OpenReports ClusterReports (the leader's), by verb (create, update, delete) and outcome (ok, error)."}, []string{"verb", "outcome"}),
		Actions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_remediation_actions_total", Help: "Remediation actions by kind (RestartProxy, Cordon, Uncordon, Page, Resolve) and outcome (done, dry_run, refused, failed)."}, []string{"action", "outcome"}),
		Slack: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_slack_messages_total", Help: "Slack deliveries by result: sent, retried (429 or 5xx), dropped (queue full), failed."}, []string{"result"}),
		Held: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "proxyaudit_remediation_held", Help: "1 while the leader holds every repair (pages only), by why: paused (proxyaudit pause) or window (outside --remediation-windows)."}, []string{"why"}),
		HeldDecisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_remediation_held_decisions_total", Help: "Repairs decided against (the node paged instead), by what held them: paused, window, silenced (Alertmanager, or Alertmanager unreachable), budget, breaker, cooldown, spent (restart budget), exempt, leaving, unrestartable (static or missing kube-proxy pod)."}, []string{"why"}),
		Alertmanager: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "proxyaudit_alertmanager_requests_total", Help: "Calls to Alertmanager's v2 API by op (post: alerts sent; alerts, silences: asked) and outcome (ok, failed)."}, []string{"op", "outcome"}),
	}
	m.Registry.MustRegister(buildinfo.Collector())
	m.Registry.MustRegister(m.ViewStale, m.Findings, m.Nodes, m.ProgrammingLag, m.FindingDelay, m.NoRulesSeen, m.StreamMessages, m.StreamBytes,
		m.StreamRejected, m.Streams, m.ReportsWaiting, m.ReportBytes, m.Resyncs, m.Refs, m.Named, m.ReadNow, m.CollectorReads, m.CollectorFallbacks, m.CollectorReadSeconds, m.CollectorReadBytes, m.HTTPDenied, m.Reconcile, m.Assessments, m.ServiceAssessments, m.Leader, m.ShardsHeld, m.ShardsUnheard, m.PartialReads, m.PartialReadBytes, m.Actions, m.ReportWrites, m.Slack, m.Held, m.HeldDecisions, m.Alertmanager,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// setVerdict publishes a verdict's counts.
func (m *Metrics) setVerdict(v *audit.Verdict) {
	kinds := map[audit.Kind]float64{}
	for _, f := range v.Findings {
		kinds[f.Kind]++
	}
	for _, k := range []audit.Kind{audit.StaleEndpoint, audit.MissingEndpoint, audit.StaleService, audit.MissingService,
		audit.NoRules, audit.StuckProxy, audit.CollectorMissing, audit.MassDivergence, audit.StaleConntrack} {
		m.Findings.WithLabelValues(string(k)).Set(kinds[k])
	}
	states := map[audit.NodeState]float64{}
	for _, n := range v.Nodes {
		states[n.State]++
	}
	for _, s := range []audit.NodeState{audit.NodeInSync, audit.NodeLagging, audit.NodeDivergent, audit.NodeStuck,
		audit.NodeNoRules, audit.NodeMissing, audit.NodePending} {
		m.Nodes.WithLabelValues(string(s)).Set(states[s])
	}
}

// sent counts the bytes a write to a stream sent (a failed write counts
// what it got out).
func (m *Metrics) sent(n int, _ error) {
	m.StreamBytes.WithLabelValues("out").Add(float64(n))
}
