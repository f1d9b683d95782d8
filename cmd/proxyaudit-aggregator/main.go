// Command proxyaudit-aggregator watches Services, EndpointSlices and Nodes,
// receives every node's kube-proxy rules from the collectors, and reports
// nodes whose rules drifted from the cluster: stale and missing endpoints,
// stuck kube-proxies, flushed tables, silent collectors. Run two or more
// replicas; a Lease elects the one that judges.
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator"
	"github.com/proxyaudit/proxyaudit/remediate"
)

const usage = `proxyaudit-aggregator compares every node's kube-proxy rules, streamed by the
proxyaudit collectors, with the cluster's Services and EndpointSlices, and
reports drift after a grace period: stale and missing endpoints per service,
StuckProxy (a kube-proxy that stopped following the API), NoRules (flushed
tables), CollectorMissing, and MassDivergence (most nodes at once: suspect the
control plane, not the nodes).

Usage:
  proxyaudit-aggregator [flags]

HTTP API (on --http-listen): GET /api/v1/findings, /api/v1/nodes,
/api/v1/nodes/{name}, /metrics, /healthz, /readyz. With --http-readers,
/api/ answers only a reader token (X-Proxyaudit-Token or Authorization:
Bearer); the others stay open.

Flags (environment fallbacks in brackets):
`

func main() {
	os.Exit(run(os.Args[1:], os.Stderr))
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func run(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("proxyaudit-aggregator", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	kubeconfig := fs.String("kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig file; empty means in-cluster configuration [KUBECONFIG]")
	streamListen := fs.String("stream-listen", ":9443", "address for collector streams")
	httpListen := fs.String("http-listen", ":8080", "address for the HTTP API, /metrics, /healthz and /readyz")
	grace := fs.Duration("grace", 30*time.Second, "how long a node may lag or differ before it is a finding (the network-programming SLO)")
	leaderElect := fs.Bool("leader-elect", true, "elect a leader through a Lease; with false this replica always leads (run only one)")
	leNamespace := fs.String("leader-elect-namespace", envOr("POD_NAMESPACE", "default"), "namespace of the leader-election Lease and of the watch barrier's Service and EndpointSlice [POD_NAMESPACE]")
	barrier := fs.Bool("watch-barrier", true, "stamp a Service and an EndpointSlice named "+aggregator.BarrierName+" every second and judge a report only once the stamps written after it arrived through the watches: a healthy node ahead of this replica's watches is never called divergent, and a watch stuck for one kind makes the view stale. Needs patch on them, and create where they do not exist (the chart creates them)")
	leName := fs.String("leader-elect-lease-name", "proxyaudit-aggregator", "name of the leader-election Lease")
	leDuration := fs.Duration("leader-elect-lease-duration", 10*time.Second, "how long followers wait after the last renewal before taking over")
	leRenew := fs.Duration("leader-elect-renew-deadline", 7*time.Second, "how long the leader keeps trying to renew before it steps down")
	recoveryGrace := fs.Duration("api-recovery-grace", 60*time.Second, "after this replica's view of the API comes back from stale (an API outage), node drift is neither reported nor repaired for this long: kube-proxies reconnect with client-go's backoff, up to 60 s")
	leRetry := fs.Duration("leader-elect-retry-period", 2*time.Second, "how often candidates try to acquire or renew the Lease")
	advertise := fs.String("advertise-address", os.Getenv("POD_IP"), "address collectors reach this replica at; with the stream port it is the leader identity followers redirect to [POD_IP]")
	audience := fs.String("token-audience", "proxyaudit", "audience the collectors' projected ServiceAccount tokens must carry")
	collectorSAs := fs.String("collector-service-accounts", envOr("POD_NAMESPACE", "default")+"/proxyaudit-collector", "comma-separated namespace/name of the collectors' ServiceAccounts")
	insecure := fs.Bool("insecure-no-auth", false, "accept streams without tokens: any client can report for any node (local experiments only; warns on every connection)")
	certFile := fs.String("tls-cert-file", "", "certificate for the stream listener; with --tls-key-file, collectors connect over TLS")
	keyFile := fs.String("tls-key-file", "", "private key for --tls-cert-file")
	maxMsg := fs.Int("max-message-bytes", 16<<20, "largest stream message accepted; larger ones end the stream")
	weightZero := fs.Duration("ipvs-weight-zero-limit", audit.DefaultWeightZeroLimit, "how long an IPVS real server may stay at weight 0 after its endpoint left the service (graceful termination keeps it while connections last) before it is a StaleEndpoint; raise it above your pods' longest terminationGracePeriodSeconds plus 15m; 0 never reports one")
	missing := fs.Int("missing-intervals", 3, "collector intervals without a report before CollectorMissing")
	massShare := fs.Float64("mass-divergence-share", 0.5, "share of reporting nodes drifting at once that makes one MassDivergence finding instead of node findings")
	massMin := fs.Int("mass-divergence-min-nodes", 3, "fewest drifted nodes that can count as mass divergence")
	rmode := fs.String("remediation", "dry-run", "remediation mode: dry-run (findings, Events and pages; no changes), restart (delete the node's kube-proxy pod), restart-and-cordon (also cordon a node still drifted after a restart)")
	rMaxNodes := fs.Int("remediation-max-nodes", 1, "most nodes in remediation at once (restarted and not yet re-audited, or cordoned by proxyaudit)")
	rMaxShare := fs.Float64("remediation-max-share", 0.1, "most nodes in remediation at once as a share of the fleet; the smaller limit holds")
	rCooldown := fs.Duration("remediation-cooldown", 10*time.Minute, "least time between two restarts of one node's kube-proxy; doubles with each further restart in the budget window")
	rBudget := fs.Int("remediation-restart-budget", 3, "kube-proxy restarts per node within --remediation-budget-window")
	rWindow := fs.Duration("remediation-budget-window", 24*time.Hour, "window of the per-node restart budget")
	rRecheck := fs.Duration("remediation-recheck", 2*time.Minute, "how long after a restart the node is re-audited; still drifted then escalates (cordon or page)")
	rExempt := fs.String("remediation-exempt-label", "proxyaudit.io/exempt", "nodes with this label key are never restarted or cordoned, only paged")
	proxyNS := fs.String("kube-proxy-namespace", "kube-system", "namespace of the kube-proxy pods")
	proxySel := fs.String("kube-proxy-selector", "k8s-app=kube-proxy", "label selector of the kube-proxy pods")
	slackTokenFile := fs.String("slack-token-file", os.Getenv("PROXYAUDIT_SLACK_TOKEN_FILE"), "file holding a Slack bot token (chat:write): one thread per incident [PROXYAUDIT_SLACK_TOKEN_FILE]; the token may also come from SLACK_BOT_TOKEN (a Secret as env)")
	slackChannel := fs.String("slack-channel", os.Getenv("PROXYAUDIT_SLACK_CHANNEL"), "Slack channel ID incidents open in, with a bot token [PROXYAUDIT_SLACK_CHANNEL]")
	slackWebhookFile := fs.String("slack-webhook-file", os.Getenv("PROXYAUDIT_SLACK_WEBHOOK_FILE"), "file holding a Slack incoming-webhook URL, for teams without a bot (no threads) [PROXYAUDIT_SLACK_WEBHOOK_FILE]")
	slackAPI := fs.String("slack-api-url", "", "Slack API base URL (tests and proxies)")
	readers := fs.String("http-readers", "", "NAMESPACE/SERVICE: serve findings (/api/) only to callers whose token the API server authenticates for --http-reader-audience and allows get on services/proxy of that Service (the permission its service proxy checks; `proxyaudit report` mints such a token). Empty: anyone who reaches --http-listen reads them")
	readerAudience := fs.String("http-reader-audience", aggregator.DefaultReaderAudience, "audience of reader tokens (--http-readers)")
	pprofListen := fs.String("debug-pprof-listen", "", "address for Go's /debug/pprof profiles (e.g. 127.0.0.1:6060); empty: off. Profiles show internals: bind it to localhost")
	cluster := fs.String("cluster-name", envOr("PROXYAUDIT_CLUSTER_NAME", "kubernetes"), "cluster name shown in pages [PROXYAUDIT_CLUSTER_NAME]")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "proxyaudit-aggregator: "+format+"\n", a...)
		return 2
	}
	if *weightZero < 0 {
		return fail("--ipvs-weight-zero-limit %s: must not be negative (0 turns the check off)", *weightZero)
	}
	if *grace < time.Second {
		return fail("--grace %s is too short: at least 1s (the Kubernetes SLO is 30s)", *grace)
	}
	if *massShare <= 0 || *massShare > 1 {
		return fail("--mass-divergence-share %g: want a share in (0, 1]", *massShare)
	}
	mode, err := remediate.ParseMode(*rmode)
	if err != nil {
		return fail("--remediation: %v", err)
	}
	if *rMaxShare < 0 || *rMaxShare > 1 || *rMaxNodes < 0 || *rBudget < 0 {
		return fail("--remediation-max-share must be in [0, 1], --remediation-max-nodes and --remediation-restart-budget at least 0")
	}
	if (*certFile == "") != (*keyFile == "") {
		return fail("--tls-cert-file and --tls-key-file go together")
	}
	_, streamPort, err := net.SplitHostPort(*streamListen)
	if err != nil {
		return fail("--stream-listen %q: %v", *streamListen, err)
	}
	_, httpPort, err := net.SplitHostPort(*httpListen)
	if err != nil {
		return fail("--http-listen %q: %v", *httpListen, err)
	}
	if *leaderElect && *advertise == "" {
		return fail("--advertise-address is required with leader election (in a pod, set POD_IP from status.podIP): followers redirect collectors to it")
	}
	self := ""
	if *advertise != "" {
		self = net.JoinHostPort(*advertise, streamPort)
	}

	var cfg *rest.Config
	if *kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", *kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return fail("API client: %v (outside a cluster, pass --kubeconfig)", err)
	}
	cfg.UserAgent = "proxyaudit-aggregator/" + version()
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return fail("API client: %v", err)
	}

	log, err := zap.NewProduction()
	if err != nil {
		return fail("logger: %v", err)
	}
	defer log.Sync()
	log = log.With(zap.String("replica", self))

	ln, err := net.Listen("tcp", *streamListen)
	if err != nil {
		return fail("--stream-listen: %v", err)
	}
	if *certFile != "" {
		cert, err := tls.LoadX509KeyPair(*certFile, *keyFile)
		if err != nil {
			return fail("--tls-cert-file/--tls-key-file: %v", err)
		}
		ln = tls.NewListener(ln, &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12})
	} else {
		log.Warn("collector streams are not encrypted (no --tls-cert-file): use only for local experiments")
	}
	hln, err := net.Listen("tcp", *httpListen)
	if err != nil {
		return fail("--http-listen: %v", err)
	}

	policy := audit.DefaultPolicy()
	policy.Grace, policy.MissingIntervals, policy.MassShare, policy.MassMinNodes = *grace, *missing, *massShare, *massMin
	policy.WeightZeroLimit = *weightZero
	clk := clock.RealClock{}
	var auth aggregator.Authenticator = aggregator.InsecureNoAuth{}
	if !*insecure {
		var sas []string
		for _, s := range strings.Split(*collectorSAs, ",") {
			if s = strings.TrimSpace(s); s != "" {
				if !strings.Contains(s, "/") {
					return fail("--collector-service-accounts %q: want namespace/name", s)
				}
				sas = append(sas, s)
			}
		}
		auth = &aggregator.TokenReviewAuth{Client: client, Audience: *audience, ServiceAccounts: sas, Clock: clk}
	} else {
		log.Warn("--insecure-no-auth: collector streams are not authenticated; any client can report for any node")
	}
	metrics := aggregator.NewMetrics()
	// Superseded versions stay matchable for four graces: a node lagging
	// less than that is lagging, not divergent.
	// With leader election, the Lease renewals (every retry period) are the
	// canary that proves this replica's watches still deliver.
	var canary *aggregator.Canary
	if *leaderElect {
		canary = &aggregator.Canary{Namespace: *leNamespace, Lease: *leName, Timeout: *leDuration}
	}
	view := aggregator.NewView(client, 4**grace, log.Named("view"), clk, canary)
	var agg *aggregator.Aggregator
	if *barrier {
		view.UseBarrier(aggregator.Barrier{Namespace: *leNamespace, Identity: self, Every: time.Second, Timeout: 10 * time.Second,
			Active: func() bool { _, leading := agg.Leader(); return leading }})
	}
	rpolicy := remediate.Policy{Mode: mode, MaxConcurrent: *rMaxNodes, MaxShare: *rMaxShare, Cooldown: *rCooldown,
		RestartBudget: *rBudget, BudgetWindow: *rWindow, Recheck: *rRecheck}
	executor := &remediate.Executor{Client: client, Policy: rpolicy, ProxyNamespace: *proxyNS, ProxySelector: *proxySel,
		Log: log.Named("remediate"), Component: "proxyaudit-aggregator",
		Observe: func(k remediate.ActionKind, o remediate.Outcome) {
			metrics.Actions.WithLabelValues(string(k), string(o)).Inc()
		}}
	var notifier *remediate.Slack
	slackCfg := remediate.SlackConfig{Channel: *slackChannel, Cluster: *cluster, APIURL: *slackAPI, Log: log.Named("slack"),
		Delivered: func(r string) { metrics.Slack.WithLabelValues(r).Inc() }}
	slackCfg.Token = os.Getenv("SLACK_BOT_TOKEN")
	if *slackTokenFile != "" {
		b, err := os.ReadFile(*slackTokenFile)
		if err != nil {
			return fail("--slack-token-file: %v", err)
		}
		slackCfg.Token = strings.TrimSpace(string(b))
	}
	if *slackWebhookFile != "" {
		b, err := os.ReadFile(*slackWebhookFile)
		if err != nil {
			return fail("--slack-webhook-file: %v", err)
		}
		slackCfg.WebhookURL = strings.TrimSpace(string(b))
	}
	if slackCfg.Token != "" || slackCfg.WebhookURL != "" {
		if notifier, err = remediate.NewSlack(slackCfg); err != nil {
			return fail("%v", err)
		}
		executor.Notifier = notifier
		log.Info("paging on Slack", zap.Bool("bot", slackCfg.Token != ""), zap.String("channel", *slackChannel))
	}
	var readerAuth *aggregator.ReaderAuth
	if *readers != "" {
		rns, rsvc, ok := strings.Cut(*readers, "/")
		if !ok || rns == "" || rsvc == "" {
			return fail("--http-readers %q: want namespace/service", *readers)
		}
		readerAuth = &aggregator.ReaderAuth{Client: client, Audience: *readerAudience, Namespace: rns, Service: rsvc, Clock: clk,
			Denied: func(r string) { metrics.HTTPDenied.WithLabelValues(r).Inc() }}
	} else {
		log.Warn("--http-readers is empty: anyone who reaches the HTTP port reads the findings (restrict it with a NetworkPolicy)")
	}
	acfg := aggregator.Config{Policy: policy, Auth: auth, Readers: readerAuth, Insecure: *insecure, MaxMessageBytes: *maxMsg,
		Self: self, Log: log.Named("aggregator"), Metrics: metrics, Clock: clk, RecoveryGrace: *recoveryGrace,
		Remediation: &aggregator.Remediation{Policy: rpolicy, Executor: executor, ExemptLabel: *rExempt}}
	if notifier != nil {
		acfg.Notifier = notifier
	}
	agg = aggregator.New(acfg, view)
	if *pprofListen != "" {
		mux := http.NewServeMux()
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
		go func() {
			psrv := &http.Server{Addr: *pprofListen, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
			log.Info("serving Go profiles", zap.String("address", *pprofListen))
			if err := psrv.ListenAndServe(); err != nil {
				log.Error("profiles", zap.Error(err))
			}
		}()
	}
	log.Info("remediation", zap.String("mode", string(mode)), zap.Int("max_nodes", *rMaxNodes), zap.Float64("max_share", *rMaxShare))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	done := make(chan struct{})
	go func() { view.Run(ctx, time.Second); close(done) }() // at most one rebuild a second, like kube-proxy's min sync period
	go agg.Run(ctx)
	if notifier != nil {
		go notifier.Run(ctx)
	}
	srv := &http.Server{Handler: agg.Handler(httpPort), ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(hln)
	streamErr := make(chan error, 1)
	go func() { streamErr <- agg.Serve(ctx, ln) }()
	log.Info("aggregator started", zap.String("stream", ln.Addr().String()), zap.String("http", hln.Addr().String()),
		zap.Duration("grace", *grace), zap.Bool("leader_elect", *leaderElect), zap.String("version", version()))

	elected := make(chan struct{})
	if *leaderElect {
		go func() {
			defer close(elected)
			err := aggregator.RunElection(ctx, client, aggregator.Election{Namespace: *leNamespace, Name: *leName, Identity: self,
				LeaseDuration: *leDuration, RenewDeadline: *leRenew, RetryPeriod: *leRetry}, agg)
			if err != nil {
				log.Error("leader election failed", zap.Error(err))
				stop()
			}
		}()
	} else {
		close(elected)
		agg.StartedLeading()
	}
	code := 0
	select {
	case <-ctx.Done():
	case err := <-streamErr:
		if err != nil {
			log.Error("stream listener failed", zap.Error(err))
			code = 1
		}
		stop()
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	srv.Shutdown(sctx)
	select {
	case <-done:
	case <-sctx.Done():
	}
	// The elector releases the Lease on the way out (ReleaseOnCancel), so
	// a follower takes over at once.
	select {
	case <-elected:
	case <-sctx.Done():
	}
	return code
}

func version() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "devel"
}
