// Command proxyaudit-aggregator watches Services, EndpointSlices and Nodes,
// receives every node's kube-proxy rules from the collectors, and reports
// nodes whose rules drifted from the cluster: stale and missing endpoints,
// stuck kube-proxies, flushed tables, silent collectors. Run two or more
// replicas; a Lease elects the one that judges.
package main

import (
	// The maintenance windows' time zones, whatever the image holds.
	_ "time/tzdata"

	"context"
	"crypto/tls"
	"crypto/x509"
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
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/proxyaudit/proxyaudit/remediate/effect"

	"go.uber.org/zap"
	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/internal/aggregator"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
	"github.com/proxyaudit/proxyaudit/internal/buildinfo"
	"github.com/proxyaudit/proxyaudit/internal/openreports"
	"github.com/proxyaudit/proxyaudit/internal/shard"
	"github.com/proxyaudit/proxyaudit/internal/tlsfile"
	"github.com/proxyaudit/proxyaudit/internal/tlssecret"
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
Bearer); the others stay open. With --shards, /internal/v1/ is the
replicas' own (partial verdicts, explain and flush on a node's holder),
answering only the replicas' ServiceAccount.

Flags (environment fallbacks in brackets):
`

func main() {
	os.Exit(run(os.Args[1:], os.Stderr))
}

func run(args []string, stderr io.Writer) int {
	o := defaultOptions()
	fs := flag.NewFlagSet("proxyaudit-aggregator", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	o.addFlags(fs)
	showVersion := fs.Bool("version", false, "print the version, commit and build date, and exit")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if *showVersion {
		fmt.Println("proxyaudit-aggregator " + buildinfo.Get().String())
		return 0
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "proxyaudit-aggregator: "+format+"\n", a...)
		return 2
	}
	if err := o.validate(); err != nil {
		return fail("%v", err)
	}
	if os.Getenv("GOMEMLIMIT") == "" && o.memoryLimit > 0 {
		debug.SetMemoryLimit(o.memoryLimit / 10 * 9)
	}
	cs, err := o.client()
	if err != nil {
		return fail("%v", err)
	}
	log, err := zap.NewProduction()
	if err != nil {
		return fail("logger: %v", err)
	}
	defer log.Sync()
	log = log.With(zap.String("replica", o.self))
	s, err := o.build(cs, log)
	if err != nil {
		return fail("%v", err)
	}
	return s.serve(log)
}

// client is the API client from --kubeconfig or the pod's service account,
// one of its own for token and access reviews (client-go's default of 5
// requests a second admitted 60 of 300 collectors in 10 s), and one for
// the leader election; and a dynamic client for the OpenReports.
func (o *options) client() (cs clients, err error) {
	var cfg *rest.Config
	if o.kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", o.kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return cs, fmt.Errorf("API client: %v (outside a cluster, pass --kubeconfig)", err)
	}
	cfg.UserAgent = "proxyaudit-aggregator/" + version()
	cs.rest = rest.CopyConfig(cfg)
	// The Lease on a client of its own: its renewals never wait behind
	// the leader's other requests (a remediation round's lookups and
	// Events once queued behind client-go's default of 5 a second).
	ecfg := rest.CopyConfig(cfg)
	ecfg.UserAgent += " (leader election)"
	cs.election, err = kubernetes.NewForConfig(ecfg)
	if err != nil {
		return cs, fmt.Errorf("API client: %v", err)
	}
	// The rest: the watch barrier's two writes a second, the incident
	// record, kube-proxy pod lookups, Events, conditions, restarts.
	cfg.QPS, cfg.Burst = 50, 100
	cs.client, err = kubernetes.NewForConfig(cfg)
	if err != nil {
		return cs, fmt.Errorf("API client: %v", err)
	}
	rcfg := rest.CopyConfig(cfg)
	// Each admission is two requests: a collector's TokenReview and the
	// GET of the pod its token names (--collector-daemonset); a reader's
	// TokenReview and SubjectAccessReview. The budgets count admissions,
	// so the client allows twice as many requests: at one each, the pod
	// GETs halved the collectors admitted a second.
	rcfg.QPS = float32(2 * (o.reviewQPS + o.readerReviewQPS))
	rcfg.Burst = 2 * (o.reviewBurst + int(2*o.readerReviewQPS))
	rcfg.UserAgent = "proxyaudit-aggregator/" + version() + " (reviews)"
	cs.reviews, err = kubernetes.NewForConfig(rcfg)
	if err != nil {
		return cs, fmt.Errorf("API client: %v", err)
	}
	// The reports' writes are paced by their writer
	// (--openreports-writes-per-second); the client only bounds bursts.
	dcfg := rest.CopyConfig(cfg)
	dcfg.QPS, dcfg.Burst = float32(2*o.reportWrites), 2*int(max(1, o.reportWrites))
	dcfg.UserAgent += " (openreports)"
	if cs.reports, err = dynamic.NewForConfig(dcfg); err != nil {
		return cs, fmt.Errorf("API client: %v", err)
	}
	return cs, nil
}

// clients are the aggregator's API clients (see options.client).
type clients struct {
	// rest is the configuration the clients were made from: its
	// credentials are also this replica's to the other replicas.
	rest                      *rest.Config
	client, reviews, election kubernetes.Interface
	reports                   dynamic.Interface
}

// server is a built aggregator replica, ready to serve.
type server struct {
	o        *options
	client   kubernetes.Interface
	election kubernetes.Interface // the Lease's own client
	view     *view.View
	agg      *aggregator.Aggregator
	notifier *effect.Slack
	streams  net.Listener
	http     net.Listener
	// internal serves the replicas' internal API (--shards); nil: off.
	internal net.Listener
	// tlsSecret keeps the stream listener's pair in a Secret (--tls-secret).
	tlsSecret *tlssecret.SecretPair
	// reports writes the OpenReports (--openreports); nil: off.
	reports *openreports.Writer
	// shards holds this replica's shards (--shards); nil: off.
	shards *shard.Coordinator
}

// servingPair is the stream listener's certificate, from files or a Secret.
type servingPair interface {
	GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error)
	NotAfter() time.Time
}

// build wires the aggregator from the options: listeners, authentication,
// view, remediation, paging.
func (o *options) build(cs clients, log *zap.Logger) (*server, error) {
	client, reviews := cs.client, cs.reviews
	s := &server{o: o, client: client, election: cs.election}
	ln, err := net.Listen("tcp", o.streamListen)
	if err != nil {
		return nil, fmt.Errorf("--stream-listen: %v", err)
	}
	var pair servingPair
	reloaded := func(notAfter time.Time, err error) {
		if err != nil {
			log.Error("the TLS certificate changed but does not load: still serving the previous pair", zap.Error(err))
			return
		}
		log.Info("TLS certificate loaded", zap.Time("not_after", notAfter))
	}
	switch {
	case o.certFile != "":
		// Re-read when the files change (cert-manager renewing the Secret):
		// the next handshake uses the new pair, no restart.
		kp, err := tlsfile.LoadKeyPair(o.certFile, o.keyFile)
		if err != nil {
			return nil, fmt.Errorf("--tls-cert-file/--tls-key-file: %v", err)
		}
		kp.Reloaded, pair = reloaded, kp
	case o.tlsSecret != "":
		s.tlsSecret = &tlssecret.SecretPair{Client: client, Namespace: o.leNamespace, Name: o.tlsSecret, Names: o.tlsNames(), Validity: o.tlsValidity, Reloaded: reloaded}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err := s.tlsSecret.Ensure(ctx)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("--tls-secret: %v (the aggregator needs get and create on that Secret)", err)
		}
		pair = s.tlsSecret
	default:
		log.Warn("collector streams are not encrypted (no --tls-cert-file or --tls-secret): use only for local experiments")
	}
	if pair != nil {
		ln = tls.NewListener(ln, &tls.Config{GetCertificate: pair.GetCertificate, MinVersion: tls.VersionTLS12})
	}
	if o.shards > 1 {
		if s.internal, err = net.Listen("tcp", o.internalListen); err != nil {
			return nil, fmt.Errorf("--internal-listen: %v", err)
		}
		if pair != nil {
			s.internal = tls.NewListener(s.internal, &tls.Config{GetCertificate: pair.GetCertificate, MinVersion: tls.VersionTLS12})
		}
	}
	s.streams = ln
	if s.http, err = net.Listen("tcp", o.httpListen); err != nil {
		return nil, fmt.Errorf("--http-listen: %v", err)
	}

	clk := clock.RealClock{}
	var collectors auth.Authenticator = auth.InsecureNoAuth{}
	if !o.insecure {
		sas, _ := o.serviceAccounts() // validated
		tra := &auth.TokenReviewAuth{Client: reviews, Audience: o.audience, ServiceAccounts: sas, Clock: clk,
			Budget: auth.NewBudget(o.reviewQPS, o.reviewBurst, 1, 5), BudgetWait: 5 * time.Second}
		collectors = tra
		if o.collectorDS != "" {
			dsNS, dsName, _ := strings.Cut(o.collectorDS, "/") // validated
			tra.Binding = &auth.DaemonSetBinding{Client: reviews, Namespace: dsNS, Name: dsName}
		} else {
			log.Warn("--collector-daemonset is empty: any pod on a node running as a collector ServiceAccount may report for that node")
		}
	} else {
		log.Warn("--insecure-no-auth: collector streams are not authenticated; any client can report for any node")
	}
	metrics := aggregator.NewMetrics()
	if pair != nil {
		metrics.Registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "proxyaudit_tls_certificate_expiry_timestamp_seconds",
			Help: "When the stream listener's TLS certificate expires (Unix seconds); it is re-read when its files or Secret change."},
			func() float64 { return float64(pair.NotAfter().Unix()) }))
	}
	// Superseded versions stay matchable for four graces: a node lagging
	// less than that is lagging, not divergent. With leader election, the
	// Lease renewals (every retry period) are the canary that proves this
	// replica's watches still deliver.
	vcfg := view.Config{Client: client, Keep: 4 * o.policy.Grace, Log: log.Named("view"), Clock: clk}
	if o.leaderElect {
		vcfg.Canary = &view.Canary{Namespace: o.leNamespace, Lease: o.leName, Timeout: o.leDuration}
	}
	if o.barrier {
		vcfg.Barrier = &view.Barrier{Namespace: o.leNamespace, Identity: o.self, Every: time.Second, Timeout: 10 * time.Second,
			Active: func() bool { return s.agg.Judging() }}
	}
	s.view = view.New(vcfg)
	executor := &effect.Executor{Client: client, Policy: o.remediation, ProxyNamespace: o.proxyNamespace, ProxySelector: o.proxySelector,
		AgentNamespace: o.agentNamespace, AgentSelector: o.agentSelector,
		Incidents: &effect.Incidents{Client: client, Namespace: o.leNamespace, Name: o.incidents, MaxAge: 30 * time.Second},
		Log:       log.Named("remediate"), Component: "proxyaudit-aggregator", Clock: clk,
		Observe: func(k remediate.ActionKind, out effect.Outcome) {
			metrics.Actions.WithLabelValues(string(k), string(out)).Inc()
		}}
	if s.notifier, err = o.slack(metrics, log); err != nil {
		return nil, err
	}
	var notifiers effect.Fanout
	if s.notifier != nil {
		notifiers = append(notifiers, s.notifier)
	}
	am, err := o.alertmanager(metrics, log, clk)
	if err != nil {
		return nil, err
	}
	if am != nil {
		notifiers = append(notifiers, am)
	}
	if len(notifiers) > 0 {
		executor.Notifier = notifiers
	}
	var readerAuth *auth.ReaderAuth
	if o.readers != "" {
		rns, rsvc, _ := o.readerService() // validated
		readerAuth = &auth.ReaderAuth{Client: reviews, Audience: o.readerAudience, Namespace: rns, Service: rsvc, Clock: clk,
			// One source address may spend half the readers' reviews: a pod
			// flooding tokens leaves the other half to the readers, who
			// come through the API server's proxy.
			Budget: auth.NewBudget(o.readerReviewQPS, max(1, int(2*o.readerReviewQPS)), o.readerReviewQPS/2, max(1, int(o.readerReviewQPS))),
			Denied: func(r auth.DenyReason) { metrics.HTTPDenied.WithLabelValues(string(r)).Inc() }}
	} else {
		log.Warn("--http-readers is empty: anyone who reaches the HTTP port reads the findings (restrict it with a NetworkPolicy)")
	}
	acfg := aggregator.Config{Policy: o.policy, Auth: collectors, Readers: readerAuth, Insecure: o.insecure, MaxMessageBytes: o.maxMessageBytes,
		Self: o.self, Peers: o.peersService, Log: log.Named("aggregator"), Metrics: metrics, Clock: clk, RecoveryGrace: o.recoveryGrace,
		Remediation: &aggregator.Remediation{Policy: o.remediation, Executor: executor, ExemptLabel: o.exemptLabel,
			Pause: &effect.Pause{Client: client, Namespace: o.leNamespace, Name: o.pause, MaxAge: 5 * time.Second, Clock: clk}, Alertmanager: am}}
	if s.notifier != nil {
		acfg.Notifier = s.notifier
	}
	if s.reports, err = o.openReports(cs, metrics, log.Named("openreports"), clk); err != nil {
		return nil, err
	}
	if s.reports != nil {
		acfg.Reports = s.reports
	}
	if o.shards > 1 {
		if acfg.Shards, err = o.shardPeers(cs, reviews, clk, s.tlsSecret, pair); err != nil {
			return nil, err
		}
		// The coordinator runs the aggregator's HoldShard for each shard
		// it takes (s.agg is set below, before Run starts it).
		s.shards, err = shard.New(shard.Config{Client: cs.election, Namespace: o.leNamespace, Prefix: fmt.Sprintf("%s-%d", o.leName, o.shards), Identity: o.self, Shards: o.shards,
			LeaseDuration: o.leDuration, RenewDeadline: o.leRenew, RetryPeriod: o.leRetry, Log: log.Named("shards"),
			OnShard: func(ctx context.Context, k int) { s.agg.HoldShard(ctx, k) }})
		if err != nil {
			return nil, fmt.Errorf("--shards: %v", err)
		}
		acfg.Shards.Holders = s.shards.Holders
		if pa := acfg.Shards.Auth; pa != nil {
			// The replicas' own addresses: reviews of their tokens never
			// wait behind a flood from elsewhere.
			pa.Replicas = func() []string { return append(s.shards.Holders(), s.agg.PeerAddresses()...) }
		}
	}
	s.agg = aggregator.New(acfg, s.view)
	executor.Lead = s.agg.Term
	log.Info("remediation", zap.String("mode", string(o.remediation.Mode)), zap.Int("max_nodes", o.remediation.MaxConcurrent),
		zap.Stringer("max_unhealthy", o.remediation.MaxUnhealthy), zap.Stringer("windows", o.remediation.Windows), zap.String("pause_configmap", o.leNamespace+"/"+o.pause))
	return s, nil
}

// shardPeers is what a sharded replica needs to reach the others: a
// client over TLS verified against the serving pair's CA and the peers
// Service's name, with its token for the peers' audience; and who the
// others must come as to be admitted (this replica's own user, asked of
// the API server: every replica runs as the same ServiceAccount).
func (o *options) shardPeers(cs clients, reviews kubernetes.Interface, clk clock.PassiveClock, secret *tlssecret.SecretPair, pair servingPair) (*aggregator.Shards, error) {
	sh := &aggregator.Shards{Count: o.shards, Port: o.internalPort}
	if o.insecure {
		return sh, nil
	}
	ns, name, _ := strings.Cut(o.peersService, "/") // validated
	roots := func() *x509.CertPool { return secret.CAPool() }
	if secret == nil {
		ca := &caFile{path: o.tlsCAFile}
		if _, err := ca.pool(); err != nil {
			return nil, fmt.Errorf("--tls-ca-file: %v", err)
		}
		roots = func() *x509.CertPool { p, _ := ca.pool(); return p }
	}
	serverName := name + "." + ns + ".svc"
	if err := peerCertificateFits(pair, roots(), serverName); err != nil {
		return nil, fmt.Errorf("--shards: %v", err)
	}
	sh.TLS = true
	sh.Client = auth.NewPeerClient(auth.PeerClientConfig{Roots: roots, ServerName: serverName, TokenFile: o.peerTokenFile, Timeout: time.Minute})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	me, err := cs.client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authnv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("--shards: asking the API server who this replica is (SelfSubjectReview), to admit only the other replicas to the internal API: %v", err)
	}
	sh.Auth = &auth.PeerAuth{Client: reviews, Username: me.Status.UserInfo.Username, Audience: o.peerAudience, Clock: clk}
	return sh, nil
}

// peerCertificateFits: the replicas verify one another's internal API by
// the serving certificate, so it must name the peers Service and chain to
// the CA they trust. A pair from cert-manager made for the collectors'
// name only would fail every partial read later, one log line each; it is
// refused at start instead.
func peerCertificateFits(pair servingPair, roots *x509.CertPool, serverName string) error {
	if pair == nil {
		return errors.New("the replicas' internal API needs the serving pair (--tls-secret or --tls-cert-file)")
	}
	cert, err := pair.GetCertificate(nil)
	if err != nil || cert == nil || cert.Leaf == nil {
		return fmt.Errorf("no serving certificate to check: %v", err)
	}
	if roots == nil {
		return errors.New("no CA to verify the replicas by: the TLS Secret needs ca.crt (or --tls-ca-file)")
	}
	inter := x509.NewCertPool()
	for _, der := range cert.Certificate[1:] {
		if c, err := x509.ParseCertificate(der); err == nil {
			inter.AddCert(c)
		}
	}
	if _, err := cert.Leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, DNSName: serverName,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		return fmt.Errorf("the serving certificate does not verify as %s against the CA (%v): the replicas check one another by that name; add it to the certificate's DNS names (cert-manager: dnsNames)", serverName, err)
	}
	return nil
}

// caFile is a CA bundle read again when the file changes (cert-manager
// renewing the mounted Secret).
type caFile struct {
	path  string
	mu    sync.Mutex
	stamp string
	last  *x509.CertPool
}

func (c *caFile) pool() (*x509.CertPool, error) {
	fi, err := os.Stat(c.path)
	if err != nil {
		return c.last, err
	}
	stamp := fmt.Sprint(fi.ModTime().UnixNano(), fi.Size())
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.last != nil && stamp == c.stamp {
		return c.last, nil
	}
	p, err := tlsfile.LoadCA(c.path)
	if err != nil {
		return c.last, err
	}
	c.last, c.stamp = p, stamp
	return p, nil
}

// openReports is the OpenReports writer the flags ask for, or nil.
func (o *options) openReports(cs clients, metrics *aggregator.Metrics, log *zap.Logger, clk clock.PassiveClock) (*openreports.Writer, error) {
	if o.reportsMode == "off" {
		return nil, nil
	}
	cfg := openreports.WriterConfig{Client: cs.reports, WritesPerSecond: o.reportWrites, Burst: max(1, int(o.reportWrites)),
		UpdateEvery: o.reportUpdate, Clock: clk, Log: log, Writes: metrics.ReportWrites, QuietNoCRD: o.reportsMode == "auto"}
	if o.reportOwner != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		cr, err := cs.client.RbacV1().ClusterRoles().Get(ctx, o.reportOwner, metav1.GetOptions{})
		cancel()
		if err != nil {
			return nil, fmt.Errorf("--openreports-owner %s: %v (the aggregator needs get on that ClusterRole; empty: reports are not deleted with it)", o.reportOwner, err)
		}
		cfg.Owner = &openreports.OwnerReference{APIVersion: "rbac.authorization.k8s.io/v1", Kind: "ClusterRole", Name: cr.Name, UID: string(cr.UID)}
	}
	log.Info("OpenReports", zap.String("mode", o.reportsMode), zap.Float64("writes_per_second", o.reportWrites), zap.Duration("update_every", o.reportUpdate), zap.String("owner", o.reportOwner))
	return openreports.NewWriter(cfg), nil
}

// slack is the Slack notifier the flags ask for, or nil.
func (o *options) slack(metrics *aggregator.Metrics, log *zap.Logger) (*effect.Slack, error) {
	cfg := effect.SlackConfig{Channel: o.slackChannel, Cluster: o.clusterName, APIURL: o.slackAPI, Log: log.Named("slack"),
		Delivered: func(r string) { metrics.Slack.WithLabelValues(r).Inc() }}
	cfg.Token = os.Getenv("SLACK_BOT_TOKEN")
	if o.slackTokenFile != "" {
		b, err := os.ReadFile(o.slackTokenFile)
		if err != nil {
			return nil, fmt.Errorf("--slack-token-file: %v", err)
		}
		cfg.Token = strings.TrimSpace(string(b))
	}
	if o.slackWebhookFile != "" {
		b, err := os.ReadFile(o.slackWebhookFile)
		if err != nil {
			return nil, fmt.Errorf("--slack-webhook-file: %v", err)
		}
		cfg.WebhookURL = strings.TrimSpace(string(b))
	}
	if cfg.Token == "" && cfg.WebhookURL == "" {
		return nil, nil
	}
	log.Info("paging on Slack", zap.Bool("bot", cfg.Token != ""), zap.String("channel", o.slackChannel))
	return effect.NewSlack(cfg)
}

// alertmanager is the Alertmanager client the flags ask for, or nil.
func (o *options) alertmanager(metrics *aggregator.Metrics, log *zap.Logger, clk clock.PassiveClock) (*effect.Alertmanager, error) {
	if o.amURLs == "" {
		return nil, nil
	}
	cfg := effect.AlertmanagerConfig{Cluster: o.clusterName, Clock: clk, Log: log.Named("alertmanager"),
		Requests: func(op, outcome string) { metrics.Alertmanager.WithLabelValues(op, outcome).Inc() }}
	for _, u := range strings.Split(o.amURLs, ",") {
		if u = strings.TrimSpace(u); u != "" {
			cfg.URLs = append(cfg.URLs, u)
		}
	}
	if o.amTokenFile != "" {
		b, err := os.ReadFile(o.amTokenFile)
		if err != nil {
			return nil, fmt.Errorf("--alertmanager-token-file: %v", err)
		}
		cfg.Token = strings.TrimSpace(string(b))
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	if o.amCAFile != "" {
		pem, err := os.ReadFile(o.amCAFile)
		if err != nil {
			return nil, fmt.Errorf("--alertmanager-ca-file: %v", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--alertmanager-ca-file %s: no PEM certificate in it", o.amCAFile)
		}
		tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	}
	cfg.HTTP = &http.Client{Timeout: 10 * time.Second, Transport: tr}
	am, err := effect.NewAlertmanager(cfg)
	if err != nil {
		return nil, fmt.Errorf("--alertmanager-url: %v", err)
	}
	log.Info("incidents are alerts in Alertmanager; its silences hold repairs", zap.Strings("urls", cfg.URLs))
	return am, nil
}

// httpTimeouts bound what one HTTP client can hold: the headers, the
// whole request, the response (the largest, /api/v1/findings of a 5,000-node
// fleet, is a few MB) and an idle keep-alive connection. Without them a
// client that sends slowly or never reads keeps a goroutine and its
// buffers for good.
var httpTimeouts = struct{ header, read, write, idle time.Duration }{10 * time.Second, 30 * time.Second, 2 * time.Minute, 2 * time.Minute}

// apiServer is the HTTP server of the API, /metrics and the probes.
func apiServer(h http.Handler) *http.Server {
	t := httpTimeouts
	return &http.Server{Handler: h, ReadHeaderTimeout: t.header, ReadTimeout: t.read, WriteTimeout: t.write, IdleTimeout: t.idle,
		MaxHeaderBytes: 64 << 10}
}

// serve runs the replica until SIGINT or SIGTERM and returns the exit code.
func (s *server) serve(log *zap.Logger) int {
	o := s.o
	if o.pprofListen != "" {
		mux := http.NewServeMux()
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
		go func() {
			psrv := &http.Server{Addr: o.pprofListen, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
			log.Info("serving Go profiles", zap.String("address", o.pprofListen))
			if err := psrv.ListenAndServe(); err != nil {
				log.Error("profiles", zap.Error(err))
			}
		}()
	}
	// signalled ends at SIGINT or SIGTERM; ctx, which everything runs
	// on, a moment later: the streams stay open while the collectors are
	// told the other replicas (Farewell).
	signalled, stopSignals := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stopSignals()
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	done := make(chan struct{})
	go func() { s.view.Run(ctx); close(done) }()
	go s.agg.Run(ctx)
	if s.tlsSecret != nil {
		go s.tlsSecret.Run(ctx)
	}
	if s.notifier != nil {
		go s.notifier.Run(ctx)
	}
	if s.reports != nil {
		go s.reports.Run(ctx)
	}
	srv := apiServer(s.agg.Handler(o.httpPort))
	go srv.Serve(s.http)
	if s.internal != nil {
		isrv := apiServer(s.agg.InternalHandler())
		go isrv.Serve(s.internal)
		defer isrv.Close()
	}
	streamErr := make(chan error, 1)
	go func() { streamErr <- s.agg.Serve(ctx, s.streams) }()
	log.Info("aggregator started", zap.String("stream", s.streams.Addr().String()), zap.String("http", s.http.Addr().String()),
		zap.Duration("grace", o.policy.Grace), zap.Bool("leader_elect", o.leaderElect), zap.String("version", version()))

	elected := make(chan struct{})
	if o.leaderElect {
		go func() {
			defer close(elected)
			err := aggregator.RunElection(ctx, s.election, aggregator.Election{Namespace: o.leNamespace, Name: o.leName, Identity: o.self,
				LeaseDuration: o.leDuration, RenewDeadline: o.leRenew, RetryPeriod: o.leRetry}, s.agg)
			if err != nil {
				log.Error("leader election failed", zap.Error(err))
				stop()
			}
		}()
	} else {
		close(elected)
		s.agg.StartedLeading()
	}
	sharded := make(chan struct{})
	if s.shards != nil {
		go func() { s.shards.Run(ctx); close(sharded) }()
	} else {
		close(sharded)
	}
	code := 0
	select {
	case <-signalled.Done():
		stopSignals() // a second signal ends the process at once
		// A rolling update's SIGTERM: the successor may have an address
		// the informer has not shown yet, and collectors whose DNS is down
		// know only what this replica tells them.
		fctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		s.agg.Farewell(fctx, s.client)
		cancel()
	case <-ctx.Done():
	case err := <-streamErr:
		if err != nil {
			log.Error("stream listener failed", zap.Error(err))
			code = 1
		}
	}
	stop()
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
	// So are the shards' Leases: their holders take them at once.
	select {
	case <-sharded:
	case <-sctx.Done():
	}
	return code
}

func version() string { return buildinfo.Version() }
