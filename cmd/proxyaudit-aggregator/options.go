package main

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
	"github.com/proxyaudit/proxyaudit/internal/api"
	"github.com/proxyaudit/proxyaudit/remediate"
)

// options are the aggregator's flags. Detection and remediation defaults
// come from audit.DefaultPolicy and remediate.DefaultPolicy, so the flags
// cannot drift from the libraries.
type options struct {
	kubeconfig               string
	tcpServices              string
	streamListen, httpListen string
	advertise                string

	policy        audit.Policy
	recoveryGrace time.Duration

	leaderElect                   bool
	leNamespace, leName           string
	leDuration, leRenew, leRetry  time.Duration
	shards                        int
	barrier                       bool
	audience, collectorSAs        string
	collectorDS                   string
	peersService                  string
	insecure                      bool
	certFile, keyFile             string
	tlsSecret, tlsServerNames     string
	tlsValidity                   time.Duration
	maxMessageBytes               int
	memoryLimit                   int64
	readers, readerAudience       string
	pprofListen                   string
	reviewQPS, readerReviewQPS    float64
	reviewBurst                   int
	remediationMode               string
	remediation                   remediate.Policy
	exemptLabel, incidents        string
	pause, windows                string
	proxyNamespace, proxySelector string
	agentNamespace, agentSelector string
	slackTokenFile, slackChannel  string
	slackWebhookFile, slackAPI    string
	clusterName                   string
	reportsMode, reportOwner      string
	reportWrites                  float64
	reportUpdate                  time.Duration
	amURLs, amTokenFile, amCAFile string
	internalListen, peerTokenFile string
	peerAudience, tlsCAFile       string
	self, streamPort, httpPort    string // derived by validate
	internalPort                  string // derived by validate
}

func defaultOptions() options {
	ns := envOr("POD_NAMESPACE", "default")
	return options{
		kubeconfig: os.Getenv("KUBECONFIG"), streamListen: ":9443", httpListen: ":8080", advertise: os.Getenv("POD_IP"),
		policy: audit.DefaultPolicy(), recoveryGrace: 60 * time.Second,
		leaderElect: true, leNamespace: ns, leName: "proxyaudit-aggregator",
		leDuration: 10 * time.Second, leRenew: 7 * time.Second, leRetry: 2 * time.Second, barrier: true,
		audience: "proxyaudit", collectorSAs: ns + "/proxyaudit-collector", maxMessageBytes: 16 << 20,
		readerAudience: api.DefaultReaderAudience, reviewQPS: 400, reviewBurst: 400, readerReviewQPS: 10,
		remediationMode: string(remediate.DefaultPolicy().Mode), remediation: remediate.DefaultPolicy(),
		exemptLabel: "proxyaudit.io/exempt", incidents: "proxyaudit-incidents", pause: "proxyaudit-pause", proxyNamespace: "kube-system", proxySelector: "k8s-app=kube-proxy",
		agentNamespace: "kube-system", agentSelector: "k8s-app=cilium",
		slackTokenFile: os.Getenv("PROXYAUDIT_SLACK_TOKEN_FILE"), slackChannel: os.Getenv("PROXYAUDIT_SLACK_CHANNEL"),
		slackWebhookFile: os.Getenv("PROXYAUDIT_SLACK_WEBHOOK_FILE"), clusterName: envOr("PROXYAUDIT_CLUSTER_NAME", "kubernetes"),
		memoryLimit: envBytes("PROXYAUDIT_MEMORY_LIMIT"),
		reportsMode: "auto", reportWrites: 20, reportUpdate: time.Minute,
		internalListen: ":8444", peerTokenFile: "/var/run/secrets/proxyaudit/peers/token", peerAudience: auth.DefaultPeerAudience,
	}
}

// envBytes reads a byte count from the environment (0 when unset; -1,
// which validate refuses, when it is not a number).
func envBytes(name string) int64 {
	v := os.Getenv(name)
	if v == "" {
		return 0
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return -1
	}
	return n
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func (o *options) addFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.kubeconfig, "kubeconfig", o.kubeconfig, "kubeconfig file; empty means in-cluster configuration [KUBECONFIG]")
	fs.StringVar(&o.streamListen, "stream-listen", o.streamListen, "address for collector streams")
	fs.StringVar(&o.httpListen, "http-listen", o.httpListen, "address for the HTTP API, /metrics, /healthz and /readyz")
	fs.DurationVar(&o.policy.Grace, "grace", o.policy.Grace, "how long a node may lag or differ before it is a finding (the network-programming SLO)")
	fs.BoolVar(&o.leaderElect, "leader-elect", o.leaderElect, "elect a leader through a Lease; with false this replica always leads (run only one)")
	fs.StringVar(&o.leNamespace, "leader-elect-namespace", o.leNamespace, "namespace of the leader-election Lease, the incident record (--incident-configmap) and the watch barrier's Service and EndpointSlice [POD_NAMESPACE]")
	fs.BoolVar(&o.barrier, "watch-barrier", o.barrier, "stamp a Service and an EndpointSlice named "+view.BarrierName+" every second and judge a report only once the stamps written after it arrived through the watches: a healthy node ahead of this replica's watches is never called divergent, and a watch stuck for one kind makes the view stale. Needs patch on them, and create where they do not exist (the chart creates them)")
	fs.StringVar(&o.leName, "leader-elect-lease-name", o.leName, "name of the leader-election Lease")
	fs.DurationVar(&o.leDuration, "leader-elect-lease-duration", o.leDuration, "how long followers wait after the last renewal before taking over")
	fs.DurationVar(&o.leRenew, "leader-elect-renew-deadline", o.leRenew, "how long the leader keeps trying to renew before it steps down")
	fs.DurationVar(&o.recoveryGrace, "api-recovery-grace", o.recoveryGrace, "after this replica's view of the API comes back from stale (an API outage), node drift is neither reported nor repaired for this long: kube-proxies reconnect with client-go's backoff, up to 60 s")
	fs.DurationVar(&o.leRetry, "leader-elect-retry-period", o.leRetry, "how often candidates try to acquire or renew the Lease")
	fs.IntVar(&o.shards, "shards", o.shards, "split the nodes into this many shards, each held by one replica through a Lease (LEASE-NAME-shard-K): a node's collector streams to its shard's holder, which judges it, and the leader concludes for the fleet from every holder's partial verdict and alone repairs and pages. Every replica must be given the same count. 0: no sharding, the leader takes every stream (up to ~5,000 nodes; see the chart README's sizing guide)")
	fs.StringVar(&o.advertise, "advertise-address", o.advertise, "address collectors reach this replica at; with the stream port it is the leader identity followers redirect to [POD_IP]")
	fs.StringVar(&o.audience, "token-audience", o.audience, "audience the collectors' projected ServiceAccount tokens must carry")
	fs.StringVar(&o.collectorSAs, "collector-service-accounts", o.collectorSAs, "comma-separated namespace/name of the collectors' ServiceAccounts")
	fs.StringVar(&o.collectorDS, "collector-daemonset", o.collectorDS, "NAMESPACE/NAME of the collector DaemonSet: admit a collector only from a pod of it (its controller, by UID) that runs the DaemonSet's own containers, images, arguments and host network (its ControllerRevision). Empty: any pod on the node running as a collector ServiceAccount, which whoever may create pods in that namespace can make")
	fs.StringVar(&o.peersService, "peers-service", o.peersService, "NAMESPACE/NAME of the headless Service the collectors resolve to find the aggregators: its endpoints' addresses are sent to every collector, which dials them when the name cannot be resolved (the node's DNS goes through its own kube-proxy; a rollout during a DNS outage would otherwise leave the fleet unheard). Empty: collectors know only what DNS told them")
	fs.BoolVar(&o.insecure, "insecure-no-auth", o.insecure, "accept streams without tokens: any client can report for any node (local experiments only; warns on every connection)")
	fs.StringVar(&o.certFile, "tls-cert-file", o.certFile, "certificate for the stream listener; with --tls-key-file, collectors connect over TLS")
	fs.StringVar(&o.keyFile, "tls-key-file", o.keyFile, "private key for --tls-cert-file")
	fs.StringVar(&o.tlsSecret, "tls-secret", o.tlsSecret, "Secret in --leader-elect-namespace holding the stream listener's pair (tls.crt, tls.key) and the CA collectors trust (ca.crt); made by the aggregator when absent (ECDSA P-256, for --tls-server-names, valid --tls-validity) and read again every 30 s, so deleting it rotates the pair. Instead of --tls-cert-file")
	fs.StringVar(&o.tlsServerNames, "tls-server-names", o.tlsServerNames, "comma-separated DNS names of a certificate --tls-secret makes (the Service names collectors dial)")
	fs.StringVar(&o.tlsCAFile, "tls-ca-file", o.tlsCAFile, "with --tls-cert-file: the CA bundle the replicas' internal API certificates are verified with (with --tls-secret, the Secret's ca.crt)")
	fs.StringVar(&o.internalListen, "internal-listen", o.internalListen, "with --shards: address of the replicas' internal API (partials, explain and flush forwarded to a node's holder), over TLS with the stream's pair; peers verify it against the CA and the --peers-service name, and send a token for --peer-audience (never their API-server credential)")
	fs.StringVar(&o.peerTokenFile, "peer-token-file", o.peerTokenFile, "with --shards: this replica's token for --peer-audience, shown to the other replicas (the chart projects it; re-read when the kubelet rotates it)")
	fs.StringVar(&o.peerAudience, "peer-audience", o.peerAudience, "with --shards: the audience the replicas' tokens for one another carry; the internal API admits no other")
	fs.DurationVar(&o.tlsValidity, "tls-validity", 3650*24*time.Hour, "validity of a CA and certificate --tls-secret makes")
	fs.IntVar(&o.maxMessageBytes, "max-message-bytes", o.maxMessageBytes, "largest stream message accepted; larger ones end the stream")
	fs.Int64Var(&o.memoryLimit, "memory-limit-bytes", o.memoryLimit, "the container's memory limit (the chart passes it from the pod spec): the Go heap is held to 90 % of it so that garbage does not carry a leader holding thousands of nodes over its limit (GOMEMLIMIT, which wins when set); a heap that needs more grows past it; 0 turns it off [PROXYAUDIT_MEMORY_LIMIT]")
	fs.DurationVar(&o.policy.WeightZeroLimit, "ipvs-weight-zero-limit", o.policy.WeightZeroLimit, "how long an IPVS real server may stay at weight 0 after its endpoint left the service (graceful termination keeps it while connections last) before it is a StaleEndpoint; raise it above your pods' longest terminationGracePeriodSeconds plus 15m; 0 never reports one")
	fs.IntVar(&o.policy.MissingIntervals, "missing-intervals", o.policy.MissingIntervals, "collector intervals without a report before CollectorMissing")
	fs.Float64Var(&o.policy.MassShare, "mass-divergence-share", o.policy.MassShare, "share of reporting nodes drifting at once that makes one MassDivergence finding instead of node findings")
	fs.IntVar(&o.policy.MassMinNodes, "mass-divergence-min-nodes", o.policy.MassMinNodes, "fewest drifted nodes that can count as mass divergence")
	fs.StringVar(&o.remediationMode, "remediation", o.remediationMode, "remediation mode: dry-run (findings, Events and pages; no changes), restart (delete the node's kube-proxy pod), restart-and-cordon (also cordon a node still drifted after a restart)")
	fs.IntVar(&o.remediation.MaxConcurrent, "remediation-max-nodes", o.remediation.MaxConcurrent, "most nodes in remediation at once: restarted and not yet re-audited, and, counted apart, cordoned by proxyaudit (a cordoned node still drifting holds further cordons, not other nodes' restarts)")
	fs.Var(&o.remediation.MaxUnhealthy, "remediation-max-unhealthy", "most nodes in remediation at once, in NodeHealthCheck's forms: a number (3), a share of the fleet rounded down (10%: none in a fleet under 10 nodes), or all nodes but N (-2); the smaller of it and --remediation-max-nodes holds")
	fs.DurationVar(&o.remediation.Cooldown, "remediation-cooldown", o.remediation.Cooldown, "least time between two restarts of one node's kube-proxy; doubles with each further restart in the budget window")
	fs.IntVar(&o.remediation.RestartBudget, "remediation-restart-budget", o.remediation.RestartBudget, "kube-proxy restarts per node within --remediation-budget-window")
	fs.DurationVar(&o.remediation.BudgetWindow, "remediation-budget-window", o.remediation.BudgetWindow, "window of the per-node restart budget")
	fs.Float64Var(&o.remediation.BreakerShare, "remediation-breaker-share", o.remediation.BreakerShare, "once more than this share of the fleet (at least one node) had kube-proxy restarted within --remediation-breaker-window, restart no further node until the window moves on: a common cause is likelier")
	fs.DurationVar(&o.remediation.BreakerWindow, "remediation-breaker-window", o.remediation.BreakerWindow, "window of the remediation breaker (0: no breaker)")
	fs.DurationVar(&o.remediation.Recheck, "remediation-recheck", o.remediation.Recheck, "how long after a restart the node is re-audited; still drifted then escalates (cordon or page)")
	fs.BoolVar(&o.remediation.Conntrack.Enabled, "remediation-conntrack", false, "delete stale UDP conntrack entries (StaleConntrack findings) on nodes whose rules are in sync, through their collectors (which must run with --conntrack-delete), under the same mode, holds, budgets and breaker as restarts")
	fs.StringVar(&o.tcpServices, "remediation-conntrack-tcp-services", "", "services (namespace/name, comma-separated) whose stale TCP connection attempts (SYN_SENT, never answered) are deleted too; an answered TCP connection is never deleted")
	fs.StringVar(&o.exemptLabel, "remediation-exempt-label", o.exemptLabel, "nodes with this label key are never restarted or cordoned, only paged")
	fs.StringVar(&o.incidents, "incident-configmap", o.incidents, "ConfigMap in --leader-elect-namespace that holds every node's incident (stage, restarts, proxyaudit's cordon): kept there, not on the Node a node's kubelet may write; created on the first incident")
	fs.StringVar(&o.pause, "pause-configmap", o.pause, "ConfigMap in --leader-elect-namespace holding the fleet-wide pause request (`proxyaudit pause` fills it, `proxyaudit resume` empties it): while it holds one, every repair is held and pages go on; absent: no pause")
	fs.StringVar(&o.windows, "remediation-windows", envOr("PROXYAUDIT_REMEDIATION_WINDOWS", ""), "maintenance windows repairs may happen in, \"DAYS HH:MM-HH:MM [ZONE]\" separated by \";\" (e.g. \"Mon-Fri 09:00-17:00 Europe/Berlin\"); outside them pages only, saying when the next opens. Empty: any time [PROXYAUDIT_REMEDIATION_WINDOWS]")
	fs.StringVar(&o.proxyNamespace, "kube-proxy-namespace", o.proxyNamespace, "namespace of the kube-proxy pods")
	fs.StringVar(&o.proxySelector, "kube-proxy-selector", o.proxySelector, "label selector of the kube-proxy pods")
	fs.StringVar(&o.agentNamespace, "cilium-namespace", o.agentNamespace, "namespace of the Cilium agent pods, restarted instead of kube-proxy on nodes where Cilium replaces it (collectors in cilium mode)")
	fs.StringVar(&o.agentSelector, "cilium-selector", o.agentSelector, "label selector of the Cilium agent pods")
	fs.StringVar(&o.slackTokenFile, "slack-token-file", o.slackTokenFile, "file holding a Slack bot token (chat:write): one thread per incident [PROXYAUDIT_SLACK_TOKEN_FILE]; the token may also come from SLACK_BOT_TOKEN (a Secret as env)")
	fs.StringVar(&o.slackChannel, "slack-channel", o.slackChannel, "Slack channel ID incidents open in, with a bot token [PROXYAUDIT_SLACK_CHANNEL]")
	fs.StringVar(&o.slackWebhookFile, "slack-webhook-file", o.slackWebhookFile, "file holding a Slack incoming-webhook URL, for teams without a bot (no threads) [PROXYAUDIT_SLACK_WEBHOOK_FILE]")
	fs.StringVar(&o.slackAPI, "slack-api-url", o.slackAPI, "Slack API base URL (tests and proxies)")
	fs.StringVar(&o.readers, "http-readers", o.readers, "NAMESPACE/SERVICE: serve findings (/api/) only to callers whose token the API server authenticates for --http-reader-audience and allows get on services/proxy of that Service (the permission its service proxy checks; `proxyaudit report` mints such a token). Empty: anyone who reaches --http-listen reads them")
	fs.StringVar(&o.readerAudience, "http-reader-audience", o.readerAudience, "audience of reader tokens (--http-readers)")
	fs.Float64Var(&o.reviewQPS, "token-review-qps", o.reviewQPS, "TokenReviews a second the leader may ask for collectors' hellos, on an API client of their own (a fleet reconnecting after a leader change: 5,000 nodes heard again within 25 s of the leader's death at 400, lease included); a hello waits up to 5 s for one, then is refused as busy and retries with its backoff. One source address gets 1 a second (burst 5)")
	fs.IntVar(&o.reviewBurst, "token-review-burst", o.reviewBurst, "burst of --token-review-qps")
	fs.Float64Var(&o.readerReviewQPS, "reader-review-qps", o.readerReviewQPS, "token and access reviews a second for HTTP API readers not decided yet (decisions are cached 30 s): a budget of their own, so a flood of reader tokens cannot delay a collector; beyond it readers get 429")
	fs.StringVar(&o.pprofListen, "debug-pprof-listen", o.pprofListen, "address for Go's /debug/pprof profiles (e.g. 127.0.0.1:6060); empty: off. Profiles show internals: bind it to localhost")
	fs.StringVar(&o.amURLs, "alertmanager-url", os.Getenv("PROXYAUDIT_ALERTMANAGER_URL"), "comma-separated base URLs of every Alertmanager replica (http://alertmanager.monitoring:9093): each incident is an alert there (alertname ProxyAuditIncident; labels node, kind, cluster, severity: warning while proxyaudit may repair, critical once it needs a human), firing while it lasts and resolved when it ends; a node whose alert a silence mutes is paged, not repaired; an Alertmanager that cannot be asked holds every repair. Empty: none [PROXYAUDIT_ALERTMANAGER_URL]")
	fs.StringVar(&o.amTokenFile, "alertmanager-token-file", o.amTokenFile, "file holding a bearer token for Alertmanager (behind an authenticating proxy); read at start")
	fs.StringVar(&o.amCAFile, "alertmanager-ca-file", o.amCAFile, "PEM file of the CAs an https Alertmanager's certificate is checked against (default: the system's)")
	fs.StringVar(&o.reportsMode, "openreports", o.reportsMode, "write the findings as OpenReports (openreports.io/v1alpha1 ClusterReport, one per node with findings, named proxyaudit-node-NODE, and proxyaudit-fleet), which Policy Reporter and hub collectors read: auto (when the API serves the CRD; checked again every minute), on (warns while it does not), off. The leader writes; a new leader adopts what it finds")
	fs.StringVar(&o.reportOwner, "openreports-owner", o.reportOwner, "ClusterRole every report is owned by, so that the garbage collector deletes them with it (the chart passes its own: helm uninstall takes the reports). Empty: reports stay until deleted")
	fs.Float64Var(&o.reportWrites, "openreports-writes-per-second", o.reportWrites, "API writes a second for the reports, fleet-wide (a storm of 5,000 nodes' reports is written over minutes at 20, never faster)")
	fs.DurationVar(&o.reportUpdate, "openreports-update-interval", o.reportUpdate, "a report whose findings change is rewritten at most this often; one appears and goes at once (within the write rate)")
	fs.StringVar(&o.clusterName, "cluster-name", o.clusterName, "cluster name shown in pages [PROXYAUDIT_CLUSTER_NAME]")
}

// validate checks the flags against each other and derives the listen
// ports and this replica's identity.
func (o *options) validate() error {
	p := o.policy
	if strings.TrimSpace(o.proxySelector) == "" || strings.TrimSpace(o.agentSelector) == "" {
		return errors.New("--kube-proxy-selector and --cilium-selector must not be empty: an empty selector matches every pod, and a restart deletes the first pod on the node it finds")
	}
	if o.shards < 0 || o.shards > 4096 {
		return fmt.Errorf("--shards %d: want 0 (no sharding) to 4096", o.shards)
	}
	if o.shards > 1 && !o.leaderElect {
		return fmt.Errorf("--shards %d needs --leader-elect: shards are held through Leases", o.shards)
	}
	if p.WeightZeroLimit < 0 {
		return fmt.Errorf("--ipvs-weight-zero-limit %s: must not be negative (0 turns the check off)", p.WeightZeroLimit)
	}
	if p.Grace < time.Second {
		return fmt.Errorf("--grace %s is too short: at least 1s (the Kubernetes SLO is 30s)", p.Grace)
	}
	if p.MassShare <= 0 || p.MassShare > 1 {
		return fmt.Errorf("--mass-divergence-share %g: want a share in (0, 1]", p.MassShare)
	}
	mode, err := remediate.ParseMode(o.remediationMode)
	if err != nil {
		return fmt.Errorf("--remediation: %v", err)
	}
	o.remediation.Mode = mode
	if o.remediation.Windows, err = remediate.ParseWindows(o.windows); err != nil {
		return fmt.Errorf("--remediation-windows: %v", err)
	}
	for _, svc := range strings.Split(o.tcpServices, ",") {
		if svc = strings.TrimSpace(svc); svc == "" {
			continue
		}
		ns, name, ok := strings.Cut(svc, "/")
		if !ok || len(validation.IsDNS1123Label(ns)) > 0 || len(validation.IsDNS1035Label(name)) > 0 {
			return fmt.Errorf("--remediation-conntrack-tcp-services: %q is not namespace/name of a service", svc)
		}
		if o.remediation.Conntrack.TCPServices == nil {
			o.remediation.Conntrack.TCPServices = map[string]bool{}
		}
		o.remediation.Conntrack.TCPServices[svc] = true
	}
	if len(o.remediation.Conntrack.TCPServices) > 0 && !o.remediation.Conntrack.Enabled {
		return errors.New("--remediation-conntrack-tcp-services takes --remediation-conntrack")
	}
	r := o.remediation
	if r.MaxConcurrent < 0 || r.RestartBudget < 0 {
		return errors.New("--remediation-max-nodes and --remediation-restart-budget must be at least 0")
	}
	if r.BreakerShare < 0 || r.BreakerShare > 1 || r.BreakerWindow < 0 {
		return fmt.Errorf("--remediation-breaker-share %g must be in [0, 1] and --remediation-breaker-window %s at least 0", r.BreakerShare, r.BreakerWindow)
	}
	switch o.reportsMode {
	case "auto", "on", "off":
	default:
		return fmt.Errorf("--openreports %q: want auto, on or off", o.reportsMode)
	}
	if o.reportWrites <= 0 || o.reportUpdate < time.Second {
		return errors.New("--openreports-writes-per-second must be positive and --openreports-update-interval at least 1s")
	}
	if o.memoryLimit < 0 {
		return fmt.Errorf("--memory-limit-bytes %d (or PROXYAUDIT_MEMORY_LIMIT %q): want a byte count, 0 to turn it off", o.memoryLimit, os.Getenv("PROXYAUDIT_MEMORY_LIMIT"))
	}
	if o.reviewQPS <= 0 || o.reviewBurst < 1 || o.readerReviewQPS <= 0 {
		return errors.New("--token-review-qps and --reader-review-qps must be positive, --token-review-burst at least 1")
	}
	if (o.certFile == "") != (o.keyFile == "") {
		return errors.New("--tls-cert-file and --tls-key-file go together")
	}
	if o.tlsSecret != "" && (o.certFile != "" || len(o.tlsNames()) == 0 || o.tlsValidity <= 0) {
		return errors.New("--tls-secret takes --tls-server-names and a positive --tls-validity, and not --tls-cert-file")
	}
	if _, o.streamPort, err = net.SplitHostPort(o.streamListen); err != nil {
		return fmt.Errorf("--stream-listen %q: %v", o.streamListen, err)
	}
	if _, o.httpPort, err = net.SplitHostPort(o.httpListen); err != nil {
		return fmt.Errorf("--http-listen %q: %v", o.httpListen, err)
	}
	if _, o.internalPort, err = net.SplitHostPort(o.internalListen); o.shards > 1 && err != nil {
		return fmt.Errorf("--internal-listen %q: %v", o.internalListen, err)
	}
	if o.shards > 1 && !o.insecure && ((o.certFile == "" && o.tlsSecret == "") || o.peersService == "" || o.peerTokenFile == "" || o.peerAudience == "") {
		return errors.New("--shards needs TLS (--tls-secret, or --tls-cert-file with --tls-ca-file), --peers-service (the name the replicas' certificate carries for them) and --peer-token-file: the replicas' internal API carries what decides repairs")
	}
	if o.shards > 1 && !o.insecure && o.certFile != "" && o.tlsCAFile == "" {
		return errors.New("--shards with --tls-cert-file needs --tls-ca-file: the CA the replicas verify one another with")
	}
	if o.leaderElect && o.advertise == "" {
		return errors.New("--advertise-address is required with leader election (in a pod, set POD_IP from status.podIP): followers redirect collectors to it")
	}
	if o.advertise != "" {
		o.self = net.JoinHostPort(o.advertise, o.streamPort)
	}
	if !o.insecure {
		if _, err := o.serviceAccounts(); err != nil {
			return err
		}
	}
	if o.readers != "" {
		if _, _, err := o.readerService(); err != nil {
			return err
		}
	}
	if ns, name, ok := strings.Cut(o.collectorDS, "/"); o.collectorDS != "" && (!ok || ns == "" || name == "") {
		return fmt.Errorf("--collector-daemonset %q: want namespace/name", o.collectorDS)
	}
	if ns, name, ok := strings.Cut(o.peersService, "/"); o.peersService != "" && (!ok || ns == "" || name == "" || strings.Contains(name, "/")) {
		return fmt.Errorf("--peers-service %q: want namespace/name of the aggregators' headless Service", o.peersService)
	}
	return nil
}

// tlsNames parses --tls-server-names.
func (o *options) tlsNames() []string {
	var out []string
	for _, n := range strings.Split(o.tlsServerNames, ",") {
		if n = strings.TrimSpace(n); n != "" {
			out = append(out, n)
		}
	}
	return out
}

// serviceAccounts parses --collector-service-accounts.
func (o *options) serviceAccounts() ([]string, error) {
	var sas []string
	for _, s := range strings.Split(o.collectorSAs, ",") {
		if s = strings.TrimSpace(s); s != "" {
			if !strings.Contains(s, "/") {
				return nil, fmt.Errorf("--collector-service-accounts %q: want namespace/name", s)
			}
			sas = append(sas, s)
		}
	}
	return sas, nil
}

// readerService parses --http-readers.
func (o *options) readerService() (string, string, error) {
	ns, svc, ok := strings.Cut(o.readers, "/")
	if !ok || ns == "" || svc == "" {
		return "", "", fmt.Errorf("--http-readers %q: want namespace/service", o.readers)
	}
	return ns, svc, nil
}
