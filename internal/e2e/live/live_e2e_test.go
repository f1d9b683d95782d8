//lint:file-ignore SA1019 the API server's service proxy of 1.36 and before reads Endpoints, which no controller manager writes here

package live

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
	"github.com/proxyaudit/proxyaudit/internal/api"

	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/chart"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
	"github.com/proxyaudit/proxyaudit/internal/testkit/findings"
)

var liveNodes = []localcluster.NodeSpec{
	{Name: "agg-ipt", Mode: localcluster.ModeIPTables, Zone: "zone-a"},
	{Name: "agg-legacy", Mode: localcluster.ModeIPTables, Zone: "zone-b", LegacyIPTables: true},
	{Name: "agg-nft", Mode: localcluster.ModeNFTables, Zone: "zone-a"},
}

func TestMain(m *testing.M) { localcluster.Main(m, liveNodes...) }

const (
	grace    = 10 * time.Second
	interval = 2 * time.Second
	// backstop is the collectors' --full-read-interval here: on legacy
	// iptables a same-size rewrite of one DNAT changes nothing the change
	// signal sees, and only the backstop read finds it (the default 5m is
	// too long for a test).
	backstop  = 15 * time.Second
	ns        = "proxyaudit"
	sa        = "proxyaudit-collector"
	audience  = "proxyaudit"
	churnNS   = "churn"
	churnSvcs = 50
)

// replicas listen on addresses of their own, like pods.
var replicaIPs = []string{"198.18.1.1", "198.18.1.2"}

type live struct {
	t        *testing.T
	c        *localcluster.Cluster
	specs    []localcluster.NodeSpec // the cluster's nodes
	replicas []string                // the aggregators' addresses
	bin      string
	dir      string
	aggs     map[string]*localcluster.Process // by IP
	cols     map[string]*localcluster.Process // by node
	svcs     []*corev1.Service
	epoch    int
	http     *http.Client
	tokens   map[string]string
	started  time.Time

	rel              *chart.Release // the chart as this test renders it
	aggSpec, colSpec *corev1.PodSpec
	kubeconfig       string // the aggregator ServiceAccount's
	sreKubeconfig    string // a user bound to the report-reader Role only
	reader           string // a reader token for the HTTP API (aggregator.readersOnly)
}

// deploy renders the chart with the e2e's values (and the test's), applies
// it to the API server, and prepares what its pods would get: the
// aggregator's ServiceAccount credentials and the pod specs the replicas
// and collectors are started from. Chart and binaries cannot drift apart:
// the processes run with exactly the flags and environment the chart
// renders, overriding only what differs on one machine (listen addresses,
// the aggregator's address without cluster DNS, in-cluster config).
func (l *live) deploy(ctx context.Context, sets []string) {
	l.t.Helper()
	root, err := localcluster.RepoRoot()
	if err != nil {
		l.t.Fatal(err)
	}
	// The subtests restart kube-proxy on node after node within minutes,
	// and the nodes keep their restart records: the breaker (planner
	// tables in remediate) would hold the later ones.
	base := []string{"grace=" + grace.String(), "collector.interval=" + interval.String(), "collector.fullReadInterval=" + backstop.String(), "tokenAudience=" + audience,
		"remediation.breakerWindow=0"}
	if l.rel, err = chart.Render(root, "proxyaudit", ns, nil, append(base, sets...)...); err != nil {
		l.t.Fatal(err)
	}
	l.rel.Cluster = l.c.Client // the TLS Secret the aggregator makes
	if err := l.rel.Apply(ctx, l.c.RESTConfig); err != nil {
		l.t.Fatal(err)
	}
	if l.aggSpec, err = l.rel.PodSpec("Deployment", "proxyaudit-aggregator"); err != nil {
		l.t.Fatal(err)
	}
	if l.colSpec, err = l.rel.PodSpec("DaemonSet", sa); err != nil {
		l.t.Fatal(err)
	}
	// The aggregator talks to the API only as the chart's ServiceAccount:
	// its RBAC is what these tests exercise.
	l.kubeconfig = filepath.Join(l.dir, "aggregator.kubeconfig")
	if err := l.c.ServiceAccountKubeconfig(ctx, ns, "proxyaudit-aggregator", l.kubeconfig); err != nil {
		l.t.Fatal(err)
	}
	const sre = "sre@example.com"
	_, err = l.c.Client.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "sre-report-reader"},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "proxyaudit-report-reader"},
		Subjects: []rbacv1.Subject{{Kind: "User", APIGroup: rbacv1.GroupName, Name: sre}}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		l.t.Fatal(err)
	}
	l.sreKubeconfig = filepath.Join(l.dir, "sre.kubeconfig")
	if err := l.c.ImpersonatingKubeconfig(sre, l.sreKubeconfig); err != nil {
		l.t.Fatal(err)
	}
}

// localArgv is env + the local binary + the container's arguments.
func (l *live) localArgv(loc *chart.Local) []string {
	argv := append([]string{"env"}, loc.Env...)
	argv = append(argv, filepath.Join(l.bin, filepath.Base(loc.Args[0])))
	return append(argv, loc.Args[1:]...)
}

func (l *live) startAggregator(ip string) {
	l.t.Helper()
	// The projected tokens the chart mounts (the peers' audience, when
	// the replicas share the fleet) are the aggregator ServiceAccount's,
	// as the kubelet would mint them.
	token := func(aud string) (string, error) {
		tr, err := l.c.Client.CoreV1().ServiceAccounts(ns).CreateToken(context.Background(), "proxyaudit-aggregator", &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
			Audiences: []string{aud}}}, metav1.CreateOptions{})
		if err != nil {
			return "", err
		}
		return tr.Status.Token, nil
	}
	loc, err := l.rel.Localize(l.aggSpec, "aggregator", filepath.Join(l.dir, "aggregator-"+ip),
		chart.Pod{Fields: map[string]string{"status.podIP": ip, "metadata.namespace": ns}, Token: token})
	if err != nil {
		l.t.Fatal(err)
	}
	// Each replica is a process on an address of its own (a pod's IP): its
	// listeners on that address only.
	argv := append(l.localArgv(loc), "--kubeconfig="+l.kubeconfig, "--stream-listen="+ip+":9443", "--http-listen="+ip+":8080", "--internal-listen="+ip+":8444")
	p, err := l.c.StartProcess("aggregator-"+ip, argv...)
	if err != nil {
		l.t.Fatal(err)
	}
	l.aggs[ip] = p
}

func (l *live) startCollector(n *localcluster.Node) {
	l.t.Helper()
	loc, err := l.rel.Localize(l.colSpec, "collector", filepath.Join(l.dir, "collector-"+n.Name),
		chart.Pod{Fields: map[string]string{"spec.nodeName": n.Name}, Token: func(aud string) (string, error) {
			return l.c.DaemonSetPodToken(context.Background(), ns, sa, n.Name, aud)
		}})
	if err != nil {
		l.t.Fatal(err)
	}
	var addrs []string
	for _, ip := range l.replicas {
		addrs = append(addrs, ip+":9443")
	}
	argv := append(l.localArgv(loc), "--aggregator="+strings.Join(addrs, ","))
	if bpffs := n.BPFFS(); bpffs != "" {
		argv = append(argv, "--bpf-root="+bpffs) // the node's own, not the host's /sys/fs/bpf
	}
	p, err := n.StartProcess("collector-"+n.Name, argv...)
	if err != nil {
		l.t.Fatal(err)
	}
	l.cols[n.Name] = p
}

// get asks the replicas in turn (a follower proxies to the leader).
func (l *live) get(path string, v any) error {
	var errs []string
	for _, ip := range l.replicas {
		req, _ := http.NewRequest(http.MethodGet, "http://"+ip+":8080"+path, nil)
		req.Header.Set(api.TokenHeader, l.reader)
		r, err := l.http.Do(req)
		if err != nil {
			errs = append(errs, err.Error())
			continue
		}
		body, _ := io.ReadAll(r.Body)
		r.Body.Close()
		if r.StatusCode != http.StatusOK {
			errs = append(errs, fmt.Sprintf("%s: %s", r.Status, body))
			continue
		}
		return json.Unmarshal(body, v)
	}
	return fmt.Errorf("GET %s: %s", path, strings.Join(errs, "; "))
}

func (l *live) findings() ([]audit.TimedFinding, error) {
	var fr api.FindingsResponse
	err := l.get("/api/v1/findings", &fr)
	return fr.Findings, err
}

// waitFor polls the findings until cond holds; deadline is generous.
func (l *live) waitFor(what string, deadline time.Duration, cond func([]audit.TimedFinding) bool) time.Duration {
	l.t.Helper()
	var fs []audit.TimedFinding
	var err error
	return testkit.Await(l.t, deadline, what, func() bool {
		fs, err = l.findings()
		return err == nil && cond(fs)
	}, func() string {
		return fmt.Sprintf("findings:\n%s\n(error: %v)\nleader logs:\n%s", findings.Describe(fs), err, l.logs())
	})
}

func (l *live) logs() string {
	var b strings.Builder
	for ip, p := range l.aggs {
		fmt.Fprintf(&b, "--- aggregator %s\n%s\n", ip, p.Tail(15))
	}
	return b.String()
}

func (l *live) nodes() map[string]audit.NodeStatus {
	var nr api.NodesResponse
	out := map[string]audit.NodeStatus{}
	if err := l.get("/api/v1/nodes", &nr); err == nil {
		for _, n := range nr.Nodes {
			out[n.Node] = n
		}
	}
	return out
}

// waitAllInSync waits for every node in sync, up to the worst case of a
// recovery after an outage of the API server: client-go's reflectors back
// off up to 30 s with up to 100 % jitter before they list again (60 s),
// the view must look fresh for 5 s, and collectors reconnect with their own
// backoff (up to 30 s, jittered). Measured after a 2-minute outage: 9 s
// to 88 s.
func (l *live) waitAllInSync(what string) {
	l.t.Helper()
	l.waitFor(what, 150*time.Second, func(fs []audit.TimedFinding) bool {
		ns := l.nodes()
		for _, n := range l.specs {
			if ns[n.Name].State != audit.NodeInSync {
				return false
			}
		}
		return len(fs) == 0
	})
}

// setEndpoints gives churn service i the endpoints of an epoch: three
// addresses that move with the epoch.
func (l *live) setEndpoints(ctx context.Context, i, epoch int) error {
	var ips []string
	for j := range 3 {
		k := (i*7 + epoch*3 + j) % 4000
		ips = append(ips, fmt.Sprintf("198.18.%d.%d", 140+k/250, 1+k%250))
	}
	return l.c.ApplySlice(ctx, localcluster.Slice(l.svcs[i], l.svcs[i].Name+"-1", "http", 8080, corev1.ProtocolTCP, ips...))
}

// newLive starts two aggregator replicas (with extra flags) and a
// collector per node of the shared cluster, on the churn services, and
// waits for every node to be in sync. Everything stops with the test.
func newLive(ctx context.Context, t *testing.T, sets ...string) *live {
	return newLiveOn(ctx, t, localcluster.Shared(t), liveNodes, replicaIPs, sets...)
}

// newLiveOn is newLive on cluster c, whose nodes are specs, with replicas
// listening on the given addresses.
func newLiveOn(ctx context.Context, t *testing.T, c *localcluster.Cluster, specs []localcluster.NodeSpec, replicas []string, sets ...string) *live {
	l := &live{t: t, c: c, specs: specs, replicas: replicas, bin: localcluster.BuildForTest(t), dir: t.TempDir(), aggs: map[string]*localcluster.Process{},
		cols: map[string]*localcluster.Process{}, http: &http.Client{Timeout: 5 * time.Second}, tokens: map[string]string{},
		started: time.Now()}
	t.Cleanup(func() {
		for _, p := range l.cols {
			p.Stop()
		}
		for _, p := range l.aggs {
			p.Stop()
		}
	})
	for i := range churnSvcs {
		name := fmt.Sprintf("churn-%02d", i)
		svc, err := c.Client.CoreV1().Services(churnNS).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			svc, err = c.CreateService(ctx, &corev1.Service{
				ObjectMeta: metav1.ObjectMeta{Namespace: churnNS, Name: name},
				Spec:       corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}},
			})
			if err != nil {
				t.Fatal(err)
			}
		}
		l.svcs = append(l.svcs, svc)
		if err := l.setEndpoints(ctx, i, l.epoch); err != nil {
			t.Fatal(err)
		}
	}
	l.deploy(ctx, sets)
	l.reader = l.mintToken(ctx, "proxyaudit-reader", api.DefaultReaderAudience)
	for _, ip := range l.replicas {
		if err := c.AddHostAddress(ctx, ip); err != nil {
			t.Fatal(err)
		}
		l.startAggregator(ip)
	}
	// The first replica to start makes the TLS pair; collectors mount its CA.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if _, err := l.rel.SecretData("proxyaudit-aggregator-tls"); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("no TLS Secret made by the aggregators: %v\n%s", err, l.logs())
		}
	}
	for _, n := range c.Nodes() {
		tok, err := c.DaemonSetPodToken(ctx, ns, sa, n.Name, audience)
		if err != nil {
			t.Fatal(err)
		}
		l.tokens[n.Name] = tok
		if err := os.WriteFile(filepath.Join(l.dir, n.Name+".token"), []byte(tok), 0o600); err != nil {
			t.Fatal(err)
		}
		l.startCollector(n)
	}
	l.aggregatorService(ctx) // after PodToken made the service account
	l.waitAllInSync("every node in sync")
	return l
}

// aggregatorService makes the replicas reachable through the API server's
// service proxy, as the chart's Service does. The replicas are host
// processes here, so each gets a stand-in Pod carrying its IP (the API
// server proxies only to addresses that are pods) and the endpoints are
// written by hand, as no controller manager runs here: Endpoints, which
// the service proxy of 1.36 and before reads, and the EndpointSlice that
// of 1.37 reads.
func (l *live) aggregatorService(ctx context.Context) {
	exists := func(err error) bool { return err == nil || strings.Contains(err.Error(), "already exists") }
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "proxyaudit-aggregator"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 8080, Protocol: corev1.ProtocolTCP}}}}
	if _, err := l.c.CreateService(ctx, svc); !exists(err) {
		l.t.Fatal(err)
	}
	port, proto, ready := int32(8080), corev1.ProtocolTCP, true
	slice := &discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "proxyaudit-aggregator-stand-in",
		Labels: map[string]string{discoveryv1.LabelServiceName: "proxyaudit-aggregator"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: new("http"), Port: &port, Protocol: &proto}}}
	for i, ip := range l.replicas {
		name := fmt.Sprintf("proxyaudit-aggregator-%d", i)
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Spec: corev1.PodSpec{ServiceAccountName: sa, AutomountServiceAccountToken: new(bool),
				Containers: []corev1.Container{{Name: "aggregator", Image: "proxyaudit:test-stand-in"}}}}
		if _, err := l.c.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); !exists(err) {
			l.t.Fatal(err)
		}
		cur, err := l.c.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			l.t.Fatal(err)
		}
		cur.Status.PodIP, cur.Status.PodIPs = ip, []corev1.PodIP{{IP: ip}}
		if _, err := l.c.Client.CoreV1().Pods(ns).UpdateStatus(ctx, cur, metav1.UpdateOptions{}); err != nil {
			l.t.Fatal(err)
		}
		slice.Endpoints = append(slice.Endpoints, discoveryv1.Endpoint{Addresses: []string{ip},
			Conditions: discoveryv1.EndpointConditions{Ready: &ready},
			TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: name}})
	}
	if _, err := l.c.Client.DiscoveryV1().EndpointSlices(ns).Create(ctx, slice, metav1.CreateOptions{}); !exists(err) {
		l.t.Fatal(err)
	}
	ep := &corev1.Endpoints{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "proxyaudit-aggregator"},
		Subsets: []corev1.EndpointSubset{{Ports: []corev1.EndpointPort{{Name: "http", Port: port, Protocol: proto}}}}}
	for _, e := range slice.Endpoints {
		ep.Subsets[0].Addresses = append(ep.Subsets[0].Addresses, corev1.EndpointAddress{IP: e.Addresses[0], TargetRef: e.TargetRef})
	}
	if _, err := l.c.Client.CoreV1().Endpoints(ns).Create(ctx, ep, metav1.CreateOptions{}); !exists(err) {
		l.t.Fatal(err)
	}
}

// report runs `proxyaudit report` the way a kubectl user does: through the
// API server's proxy, as someone bound to the chart's report-reader Role.
func (l *live) report(t *testing.T, args ...string) (string, int) {
	t.Helper()
	return l.cli(t, append([]string{"report"}, args...)...)
}

// withUnreachableContext writes the SRE's kubeconfig with a second
// context, "gone", whose API server does not answer; it returns the file
// and the live context's name.
func (l *live) withUnreachableContext(t *testing.T) (string, string) {
	t.Helper()
	cfg, err := clientcmd.LoadFromFile(l.sreKubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	cur := cfg.Contexts[cfg.CurrentContext]
	if cur == nil {
		t.Fatalf("the SRE's kubeconfig has no current context")
	}
	gone := clientcmdapi.NewCluster()
	gone.Server = "https://127.0.0.1:1"
	gone.CertificateAuthority = cfg.Clusters[cur.Cluster].CertificateAuthority
	cfg.Clusters["gone"] = gone
	ctx := clientcmdapi.NewContext()
	ctx.Cluster, ctx.AuthInfo = "gone", cur.AuthInfo
	cfg.Contexts["gone"] = ctx
	path := filepath.Join(l.dir, "two-clusters.kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path, cfg.CurrentContext
}

// cli runs `kubectl proxyaudit SUBCOMMAND` as that user: the genuine
// kubectl finds the plugin on PATH, the plugin the kubeconfig in
// KUBECONFIG, as on a workstation.
func (l *live) cli(t *testing.T, args ...string) (string, int) {
	t.Helper()
	cmd, err := (&localcluster.System{C: l.c, Bin: l.bin}).Kubectl(context.Background(), l.sreKubeconfig, append(args, "-n", ns)...)
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.CombinedOutput()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return string(out), code
}

// streamIn reads the leader's inbound stream bytes and report count.
func (l *live) streamIn(t *testing.T) (bytes, reports float64) {
	t.Helper()
	m := l.metrics(t)
	return m[`proxyaudit_stream_bytes_total{direction="in"}`], m[`proxyaudit_stream_messages_total{direction="in",type="report"}`]
}

// metrics reads the leader's /metrics: series (name and labels) to value.
func (l *live) metrics(t *testing.T) map[string]float64 {
	t.Helper()
	r, err := l.http.Get("http://" + strings.TrimSuffix(l.leader(context.Background()), ":9443") + ":8080/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Body.Close()
	body, _ := io.ReadAll(r.Body)
	out := map[string]float64{}
	for _, line := range strings.Split(string(body), "\n") {
		i := strings.LastIndexByte(line, ' ')
		if i < 0 || strings.HasPrefix(line, "#") {
			continue
		}
		var v float64
		if _, err := fmt.Sscanf(line[i+1:], "%g", &v); err == nil {
			out[line[:i]] = v
		}
	}
	return out
}

func (l *live) leader(ctx context.Context) string {
	lease, err := l.c.Client.CoordinationV1().Leases(ns).Get(ctx, "proxyaudit-aggregator", metav1.GetOptions{})
	if err != nil || lease.Spec.HolderIdentity == nil {
		return ""
	}
	return *lease.Spec.HolderIdentity
}

// The live system on a real cluster: two aggregator replicas on the host,
// a collector per node in its namespace, genuine kube-proxies (iptables on
// nf_tables, iptables legacy, nftables).
func TestE2ELiveSystem(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	l := newLive(ctx, t)
	t.Run("bad streams are rejected and record nothing", func(t *testing.T) { l.badStreams(ctx, t) })
	t.Run("the HTTP API serves findings to readers only", func(t *testing.T) { l.readersOnly(ctx, t) })
	t.Run("churn gives no findings", func(t *testing.T) { l.churn(ctx, t) })
	t.Run("a flood of churn gives no findings", func(t *testing.T) { l.flood(ctx, t) })
	t.Run("a partitioned collector is missing, not stale", func(t *testing.T) { l.partitioned(ctx, t) })
	t.Run("hung informer is a stuck proxy", func(t *testing.T) { l.hungInformer(ctx, t) })
	t.Run("leader killed", func(t *testing.T) { l.leaderKilled(ctx, t) })
	t.Run("collector stopped is missing, not stale", func(t *testing.T) { l.collectorStopped(ctx, t) })
	t.Run("tampered rule", func(t *testing.T) { l.tampered(ctx, t) })
	t.Run("flushed rules", func(t *testing.T) { l.flushed(ctx, t) })
	t.Run("kube-proxy never sees the watch barrier", func(t *testing.T) {
		// The leader stamped its barrier every second for the whole run:
		// kube-proxy's watches must have filtered both objects out.
		for _, n := range l.c.Nodes() {
			b, err := os.ReadFile(n.ProxyLog())
			if err != nil {
				t.Fatal(err)
			}
			if k := strings.Count(string(b), view.BarrierName); k > 0 {
				t.Errorf("%s: kube-proxy's log names %s %d times", n.Name, view.BarrierName, k)
			}
		}
	})
}

// tlsConfig trusts the CA the aggregator made, as the collectors do.
func (l *live) tlsConfig(t *testing.T) *tls.Config {
	t.Helper()
	data, err := l.rel.SecretData("proxyaudit-aggregator-tls")
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(data["ca.crt"]) {
		t.Fatal("no CA in the chart's TLS Secret")
	}
	return &tls.Config{RootCAs: pool, ServerName: "proxyaudit-aggregator." + ns + ".svc", MinVersion: tls.VersionTLS12}
}

func (l *live) rejectedBy(t *testing.T, hello *stream.Message, raw []byte) string {
	t.Helper()
	leader := l.leader(context.Background())
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", leader, l.tlsConfig(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if raw != nil {
		conn.Write(raw)
	} else if err := stream.Write(conn, hello); err != nil {
		t.Fatal(err)
	}
	conn.SetReadDeadline(time.Now().Add(15 * time.Second))
	m, _, err := stream.Read(conn, 1<<20)
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	if m.Type != stream.TypeReject || m.Reject == nil {
		t.Fatalf("not rejected: %+v", m)
	}
	return m.Reject.Reason
}

// roguePodToken is a collector token of a pod someone who may create pods
// in the namespace put on node: the collector's own pod spec, with
// spec.nodeName set by hand rather than by the DaemonSet.
func (l *live) roguePodToken(ctx context.Context, t *testing.T, node string) string {
	t.Helper()
	spec := l.colSpec.DeepCopy()
	spec.NodeName = node
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "rogue-" + node}, Spec: *spec}
	p, err := l.c.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		p, err = l.c.Client.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
	}
	if err != nil {
		t.Fatal(err)
	}
	tr, err := l.c.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		Audiences: []string{audience}, BoundObjectRef: &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: p.Name, UID: p.UID}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return tr.Status.Token
}

func (l *live) badStreams(ctx context.Context, t *testing.T) {
	other, err := l.c.PodToken(ctx, ns, sa, "agg-ipt", "not-proxyaudit")
	if err != nil {
		t.Fatal(err)
	}
	hello := func(node, token string) *stream.Message {
		return &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{Node: node, Token: token, IntervalSeconds: 2}}
	}
	revoked := l.revokedToken(ctx, t, "agg-ipt")
	rogue := l.roguePodToken(ctx, t, "agg-ipt")
	expired := l.expiredToken(ctx, t, "agg-ipt")
	huge := make([]byte, 4)
	binary.BigEndian.PutUint32(huge, 100<<20)
	for _, tc := range []struct {
		name  string
		hello *stream.Message
		raw   []byte
		says  string
	}{
		{"no token", hello("agg-nft", ""), nil, "no token"},
		{"token of another node", hello("agg-nft", l.tokens["agg-ipt"]), nil, `bound to node "agg-ipt"`},
		{"token for a node that does not exist", hello("ghost", l.tokens["agg-ipt"]), nil, `bound to node "agg-ipt"`},
		{"wrong audience", hello("agg-ipt", other), nil, "audience"},
		{"forged token", hello("agg-ipt", "eyJhbGciOiJSUzI1NiJ9.e30.c2ln"), nil, "unauthenticated"},
		{"token of a pod that is gone", hello("agg-ipt", revoked), nil, "unauthenticated"},
		// Whoever may create pods in the namespace can put one on any node.
		{"token of a pod on the node that is not the DaemonSet's", hello("agg-ipt", rogue), nil, "is not a pod of DaemonSet"},
		// The aggregator refuses an expired token itself, before any TokenReview.
		{"expired token", hello("agg-ipt", expired), nil, "the token expired at"},
		{"garbage", nil, []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), "larger than the limit"},
		{"100 MB message", nil, huge, "larger than the limit"},
	} {
		if got := l.rejectedBy(t, tc.hello, tc.raw); !strings.Contains(got, tc.says) {
			t.Errorf("%s: rejected with %q, want it to say %q", tc.name, got, tc.says)
		}
	}
	if ns := l.nodes(); len(ns) != len(l.specs) {
		t.Errorf("rejected streams recorded nodes: %v", ns)
	}
	var nr api.NodeResponse
	if err := l.get("/api/v1/nodes/ghost", &nr); err == nil || !strings.Contains(err.Error(), "404") {
		t.Errorf("ghost node known: %v %+v", err, nr)
	}
	fs, err := l.findings()
	if err != nil || len(fs) != 0 {
		t.Errorf("findings after bad streams: %v\n  %s", err, findings.Describe(fs))
	}
}

// 50 services, 20 endpoint changes per second for two minutes: every
// kube-proxy keeps up, so nothing may be reported.
func (l *live) churn(ctx context.Context, t *testing.T) {
	d := 2 * time.Minute
	if testing.Short() {
		d = 20 * time.Second
	}
	stop := time.Now().Add(d)
	var mu sync.Mutex
	var seen []audit.TimedFinding
	done := make(chan struct{})
	go func() {
		defer close(done)
		for time.Now().Before(stop.Add(grace + 2*interval)) {
			if fs, err := l.findings(); err == nil && len(fs) > 0 {
				mu.Lock()
				seen = append(seen, fs...)
				mu.Unlock()
			}
			time.Sleep(time.Second)
		}
	}()
	steadyIn, steadyMsgs := l.streamIn(t)
	time.Sleep(5 * interval)
	steadyIn2, steadyMsgs2 := l.streamIn(t)
	t.Logf("steady state: %.0f bytes per report (%.0f reports)", (steadyIn2-steadyIn)/(steadyMsgs2-steadyMsgs), steadyMsgs2-steadyMsgs)
	for name, n := range l.nodes() {
		if n.KubeProxy == nil || n.KubeProxy.LastSync.IsZero() || n.KubeProxy.Error != "" {
			t.Errorf("%s: kube-proxy's own metrics not forwarded: %+v", name, n.KubeProxy)
		}
	}
	churnIn, churnMsgs := l.streamIn(t)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	changes := 0
	for time.Now().Before(stop) {
		<-tick.C
		l.epoch++
		if err := l.setEndpoints(ctx, changes%churnSvcs, l.epoch); err != nil {
			t.Fatal(err)
		}
		changes++
	}
	churnIn2, churnMsgs2 := l.streamIn(t)
	<-done
	t.Logf("churn: %d endpoint changes in %s (%.1f/s); %.0f bytes per report (%.0f reports)", changes, d, float64(changes)/d.Seconds(),
		(churnIn2-churnIn)/(churnMsgs2-churnMsgs), churnMsgs2-churnMsgs)
	if len(seen) > 0 {
		t.Fatalf("findings during churn:\n%s", findings.Describe(seen))
	}
	for name, n := range l.nodes() {
		t.Logf("%s: programming lag p50 %.1fs p99 %.1fs max %.1fs over %d samples", name, n.Lag.P50, n.Lag.P99, n.Lag.Max, n.Lag.Samples)
	}
}

func (l *live) hungInformer(ctx context.Context, t *testing.T) {
	n := l.c.Node("agg-ipt")
	undo, err := n.HangInformer(ctx)
	if err != nil {
		t.Fatal(err)
	}
	l.epoch++
	for i := range 3 {
		if err := l.setEndpoints(ctx, i, l.epoch); err != nil {
			t.Fatal(err)
		}
	}
	took := l.waitFor("StuckProxy on agg-ipt", grace+2*interval+30*time.Second, func(fs []audit.TimedFinding) bool {
		return findings.Has(fs, "agg-ipt", audit.StuckProxy)
	})
	t.Logf("StuckProxy reported %s after the change (grace %s, interval %s)", took.Round(100*time.Millisecond), grace, interval)
	fs, _ := l.findings()
	for _, f := range fs {
		if f.Kind == audit.StuckProxy && !strings.Contains(f.Detail, "does not know it is behind") {
			t.Errorf("StuckProxy detail lacks kube-proxy's own view (no pending changes): %s", f.Detail)
		}
	}
	if out, code := l.report(t); code != 1 || !strings.Contains(out, "1 stuck") || !strings.Contains(out, "agg-ipt (Stuck)") {
		t.Errorf("proxyaudit report through the API server: exit %d\n%s", code, out)
	}
	// The same cluster beside one whose API server is gone, in one
	// report: the live one's findings under its name, the other named
	// with why, exit status 2.
	multi, live := l.withUnreachableContext(t)
	out, code := l.report(t, "--kubeconfig", multi, "--context", live, "--context", "gone")
	gone, stuck := false, false
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		gone = gone || len(f) > 2 && f[0] == "gone" && f[1] == "-" && strings.Contains(line, "UNREADABLE: cannot reach the API server")
		stuck = stuck || len(f) > 2 && f[0] == live && f[1] == "agg-ipt"
	}
	if code != 2 || !gone || !stuck {
		t.Errorf("proxyaudit report across a live and a gone cluster: exit %d\n%s", code, out)
	}
	if out, code := l.cli(t, "explain", "node", "agg-ipt", "--service", churnNS+"/churn-00"); code != 1 ||
		strings.Count(out, "STALE") != 3 || strings.Count(out, "MISSING") != 3 || !strings.Contains(out, "KUBE-SVC-") {
		t.Errorf("proxyaudit explain through the API server: exit %d\n%s", code, out)
	}
	if out, code := l.cli(t, "explain", "node", "agg-nft", "--service", churnNS+"/churn-00"); code != 0 || strings.Contains(out, "STALE") {
		t.Errorf("proxyaudit explain of a healthy node: exit %d\n%s", code, out)
	}
	// The three services changed one API call after another: each is
	// stale once its own change outlives grace, so the last may follow
	// the first (and StuckProxy) by the calls' spacing and a judging
	// cycle (seen once: only churn-00's when StuckProxy came).
	staleOf := func(fs []audit.TimedFinding) int {
		n := 0
		for _, f := range fs {
			if f.Kind == audit.StaleEndpoint && strings.HasPrefix(f.Service, churnNS+"/churn-0") {
				n++
			}
		}
		return n
	}
	l.waitFor("the 3 stale endpoints of each of 3 services", 2*interval+10*time.Second, func(fs []audit.TimedFinding) bool { return staleOf(fs) == 9 })
	fs, _ = l.findings()
	if len(findings.Only(fs, "agg-ipt")) != len(fs) {
		t.Errorf("findings on healthy nodes:\n%s", findings.Describe(fs))
	}
	if stale := staleOf(fs); stale != 9 {
		t.Errorf("want the 3 stale endpoints of each of 3 services, got %d:\n%s", stale, findings.Describe(fs))
	}
	if err := undo(ctx); err != nil {
		t.Fatal(err)
	}
	l.waitAllInSync("agg-ipt recovered after the fault was lifted")
	if out, code := l.report(t, "-o", "markdown"); code != 0 || !strings.Contains(out, "3 in sync") {
		t.Errorf("proxyaudit report after recovery: exit %d\n%s", code, out)
	}
}

func (l *live) leaderKilled(ctx context.Context, t *testing.T) {
	old := l.leader(ctx)
	ip, _, _ := net.SplitHostPort(old)
	p := l.aggs[ip]
	if p == nil {
		t.Fatalf("leader %q is not one of our replicas", old)
	}
	p.Kill()
	start := time.Now()
	for {
		if cur := l.leader(ctx); cur != "" && cur != old {
			t.Logf("leader %s killed; %s leads after %s", old, cur, time.Since(start).Round(100*time.Millisecond))
			break
		}
		if time.Since(start) > 30*time.Second {
			t.Fatalf("no new leader 30 s after killing %s", old)
		}
		time.Sleep(200 * time.Millisecond)
	}
	l.startAggregator(ip) // the Deployment's replacement pod
	l.waitAllInSync("collectors reconnected to the new leader")
	// Findings continue: the new leader judges a fresh change.
	l.epoch++
	if err := l.setEndpoints(ctx, 10, l.epoch); err != nil {
		t.Fatal(err)
	}
	l.waitAllInSync("the new leader follows changes")
}

func (l *live) collectorStopped(ctx context.Context, t *testing.T) {
	n := l.c.Node("agg-nft")
	l.cols[n.Name].Stop()
	took := l.waitFor("CollectorMissing on agg-nft", 3*interval+30*time.Second, func(fs []audit.TimedFinding) bool {
		return findings.Has(fs, "agg-nft", audit.CollectorMissing)
	})
	t.Logf("CollectorMissing after %s", took.Round(100*time.Millisecond))
	// Changes meanwhile are not blamed on the silent node.
	l.epoch++
	if err := l.setEndpoints(ctx, 20, l.epoch); err != nil {
		t.Fatal(err)
	}
	time.Sleep(grace + 2*interval)
	fs, _ := l.findings()
	if len(fs) != 1 || fs[0].Kind != audit.CollectorMissing {
		t.Fatalf("want only CollectorMissing, got:\n%s", findings.Describe(fs))
	}
	l.startCollector(n)
	l.waitAllInSync("agg-nft's collector back")
}

func (l *live) tampered(ctx context.Context, t *testing.T) {
	// Endpoints no other service has (the churn reuses its IPs across
	// services), so the rewritten rule is churn-30's and nobody else's.
	const own = "198.18.198.1"
	if err := l.c.ApplySlice(ctx, localcluster.Slice(l.svcs[30], l.svcs[30].Name+"-1", "http", 8080, corev1.ProtocolTCP, own, "198.18.198.2")); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"agg-nft", "agg-legacy"} {
		if err := l.c.Node(name).WaitRules(ctx, 30*time.Second, "churn-30 on "+own, func(rules string) bool {
			return l.c.Node(name).RoutesTo(rules, own+":8080")
		}); err != nil {
			t.Fatal(err)
		}
	}
	l.waitAllInSync("churn-30 on endpoints of its own")
	for _, name := range []string{"agg-nft", "agg-legacy"} {
		n := l.c.Node(name)
		from := own + ":8080"
		if err := n.TamperEndpoint(ctx, from, "198.18.199.99:8080"); err != nil {
			t.Fatal(err)
		}
		// nf_tables announces the rewrite; legacy's is found by the
		// backstop read.
		l.waitFor("the tampered service on "+name, backstop+grace+2*interval+30*time.Second, func(fs []audit.TimedFinding) bool {
			var kinds []string
			for _, f := range fs {
				if f.Node == name && f.Service == churnNS+"/churn-30" {
					kinds = append(kinds, string(f.Kind)+" "+f.Endpoint)
				}
			}
			return len(fs) == 2 && strings.Join(kinds, ",") == "MissingEndpoint "+from+",StaleEndpoint 198.18.199.99:8080"
		})
		if err := n.RestartProxy(ctx); err != nil {
			t.Fatal(err)
		}
		l.waitAllInSync(name + " repaired by a kube-proxy restart")
	}
}

// A flush repaired within grace is not a finding; a flush kube-proxy
// cannot repair (frozen) is NoRules. (kube-proxy 1.36 does not restore an
// `iptables -t nat -F` by itself within minutes: its canary chains survive
// the flush. The repair here is a restart, as the kubelet would do after a
// failed liveness check, or an operator.)
func (l *live) flushed(ctx context.Context, t *testing.T) {
	n := l.c.Node("agg-legacy")
	if err := n.FlushRules(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(interval)
	if err := n.RestartProxy(ctx); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(grace + 3*interval)
	for time.Now().Before(deadline) {
		if fs, err := l.findings(); err == nil && len(fs) > 0 {
			t.Fatalf("a flush repaired within grace was reported:\n%s", findings.Describe(fs))
		}
		time.Sleep(time.Second)
	}

	thaw, err := n.Freeze(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := n.FlushRules(ctx); err != nil {
		thaw(ctx)
		t.Fatal(err)
	}
	took := l.waitFor("NoRules on agg-legacy", grace+2*interval+30*time.Second, func(fs []audit.TimedFinding) bool {
		return len(fs) == 1 && findings.Has(fs, "agg-legacy", audit.NoRules)
	})
	t.Logf("NoRules reported %s after the flush", took.Round(100*time.Millisecond))
	if err := thaw(ctx); err != nil {
		t.Fatal(err)
	}
	if err := n.RestartProxy(ctx); err != nil {
		t.Fatal(err)
	}
	l.waitAllInSync("agg-legacy restored")
}

// The control plane misbehaves while every kube-proxy is healthy: nothing
// may be reported, nothing repaired, and everything must recover without
// anyone's help. Each case logs what was injected and what the system did.
func TestE2EControlPlaneFaults(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	c := localcluster.Shared(t)
	l := newLive(ctx, t)
	fault := func(t *testing.T, what string, inject func() (localcluster.Undo, error), hold time.Duration) {
		seen := l.watchFindings()
		undo, err := inject()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("injected: %s for %s", what, hold)
		time.Sleep(hold)
		if err := undo(ctx); err != nil {
			t.Fatal(err)
		}
		healed := time.Now()
		t.Logf("healed: %s", what)
		// Endpoints change as soon as the API is back: the kube-proxies
		// and the aggregator must all catch up, within grace.
		for i := range 40 {
			l.epoch++
			if err := l.setEndpoints(ctx, i%churnSvcs, l.epoch); err != nil {
				t.Fatal(err)
			}
			time.Sleep(100 * time.Millisecond)
		}
		l.waitAllInSync("every node in sync after " + what)
		t.Logf("back in sync %s after healing (a leader elected, informers relisted)", time.Since(healed).Round(100*time.Millisecond))
		time.Sleep(grace + 2*interval)
		if fs := seen(); len(fs) > 0 {
			t.Errorf("findings reported around %s:\n%s", what, findings.Describe(fs))
		}
	}
	t.Run("etcd paused for 60s", func(t *testing.T) { fault(t, "etcd SIGSTOPped", c.PauseEtcd, 60*time.Second) })
	t.Run("API server down for 2 minutes", func(t *testing.T) { fault(t, "kube-apiserver stopped", c.StopAPIServer, 2*time.Minute) })
}

// watchFindings polls the findings until the returned function is called,
// which returns every finding seen (the API being unreachable is not one).
func (l *live) watchFindings() func() []audit.TimedFinding {
	var mu sync.Mutex
	var seen []audit.TimedFinding
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-time.After(500 * time.Millisecond):
			}
			if fs, err := l.findings(); err == nil && len(fs) > 0 {
				mu.Lock()
				seen = append(seen, fs...)
				mu.Unlock()
			}
		}
	}()
	return func() []audit.TimedFinding {
		close(stop)
		<-done
		mu.Lock()
		defer mu.Unlock()
		return seen
	}
}

// flood changes endpoints 1,000 times as fast as the API takes it (about
// ten seconds here) while every kube-proxy is healthy: kube-proxy batches
// the changes, and nothing may be reported.
func (l *live) flood(ctx context.Context, t *testing.T) {
	seen := l.watchFindings()
	start := time.Now()
	const changes = 1000
	for i := range changes {
		l.epoch++
		if err := l.setEndpoints(ctx, i%churnSvcs, l.epoch); err != nil {
			t.Fatal(err)
		}
	}
	took := time.Since(start)
	t.Logf("injected: %d endpoint changes in %s (%.0f/s)", changes, took.Round(100*time.Millisecond), changes/took.Seconds())
	l.waitAllInSync("every node in sync after the flood")
	t.Logf("every node in sync %s after the flood ended", (time.Since(start) - took).Round(100*time.Millisecond))
	time.Sleep(grace + 2*interval)
	if fs := seen(); len(fs) > 0 {
		t.Errorf("findings during a flood of churn on healthy nodes:\n%s", findings.Describe(fs))
	}
}

// partitioned cuts one node's collector off from both replicas (its
// kube-proxy keeps following the API) while endpoints change: the node is
// CollectorMissing, never stale, and after healing it is back in sync with
// at most one full resync.
func (l *live) partitioned(ctx context.Context, t *testing.T) {
	n := l.c.Node("agg-legacy")
	resyncs := l.metrics(t)["proxyaudit_stream_resyncs_total"]
	undo, err := n.Partition(ctx, 9443, l.replicas...)
	if err != nil {
		t.Fatal(err)
	}
	defer undo(ctx)
	t.Log("injected: agg-legacy's collector partitioned from both aggregator replicas")
	seen := l.watchFindings()
	for i := range 10 {
		l.epoch++
		if err := l.setEndpoints(ctx, i, l.epoch); err != nil {
			t.Fatal(err)
		}
	}
	took := l.waitFor("agg-legacy CollectorMissing", 3*interval+30*time.Second, func(fs []audit.TimedFinding) bool {
		return findings.Has(fs, "agg-legacy", audit.CollectorMissing)
	})
	t.Logf("CollectorMissing %s after the partition", took.Round(100*time.Millisecond))
	time.Sleep(grace + 2*interval) // long enough for a stale finding, were the node judged
	if err := undo(ctx); err != nil {
		t.Fatal(err)
	}
	t.Log("healed")
	l.waitAllInSync("agg-legacy back after the partition")
	for _, f := range seen() {
		if f.Kind != audit.CollectorMissing {
			t.Errorf("%s %s %s %s during a partition: only CollectorMissing may be reported", f.Node, f.Kind, f.Service, f.Endpoint)
		}
	}
	if d := l.metrics(t)["proxyaudit_stream_resyncs_total"] - resyncs; d > 1 {
		t.Errorf("%.0f resyncs after healing, want at most 1", d)
	}
}

// mintToken is a one-hour token of ServiceAccount name in the release
// namespace for audience.
func (l *live) mintToken(ctx context.Context, name, audience string) string {
	l.t.Helper()
	exp := int64(3600)
	tr, err := l.c.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, name, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		Audiences: []string{audience}, ExpirationSeconds: &exp}}, metav1.CreateOptions{})
	if err != nil {
		l.t.Fatalf("token for %s/%s: %v", ns, name, err)
	}
	return tr.Status.Token
}

// readersOnly: a pod that reaches the aggregator's port reads findings only
// with a token the real API server authenticates for the reader audience
// and whose subject RBAC lets through the service proxy; the SRE's CLI gets
// one through the API server.
func (l *live) readersOnly(ctx context.Context, t *testing.T) {
	if _, err := l.c.Client.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "not-a-reader"}},
		metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	leader := strings.TrimSuffix(l.leader(ctx), ":9443")
	getPath := func(path, header, value string) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, "http://"+leader+":8080"+path, nil)
		if header != "" {
			req.Header.Set(header, value)
		}
		r, err := l.http.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Body.Close()
		b, _ := io.ReadAll(r.Body)
		return r.StatusCode, string(b)
	}
	get := func(header, value string) (int, string) { return getPath("/api/v1/findings", header, value) }
	for _, tc := range []struct {
		name, header, value string
		code                int
		says                string
	}{
		{"no token", "", "", 401, "findings are for readers only"},
		{"a collector's token (another audience)", api.TokenHeader, l.tokens["agg-ipt"], 401, "audience"},
		{"a ServiceAccount RBAC does not let through", "Authorization", "Bearer " + l.mintToken(ctx, "not-a-reader", api.DefaultReaderAudience), 403, "may not read findings"},
		{"the reader", api.TokenHeader, l.reader, 200, `"findings"`},
	} {
		code, body := get(tc.header, tc.value)
		if code != tc.code || !strings.Contains(body, tc.says) {
			t.Errorf("%s: %d %s, want %d saying %q", tc.name, code, strings.TrimSpace(body), tc.code, tc.says)
		} else {
			t.Logf("%s: %d", tc.name, code)
		}
		// The status page answers exactly as the API does.
		for _, path := range []string{"/ui/", "/ui/incidents", "/ui/static/style.css"} {
			if ucode, ubody := getPath(path, tc.header, tc.value); ucode != code || (code != 200 && ubody != body) {
				t.Errorf("%s: %s answers %d %s; the API %d %s", tc.name, path, ucode, strings.TrimSpace(ubody), code, strings.TrimSpace(body))
			}
		}
	}
	if out, code := l.report(t); code != 0 {
		t.Errorf("the SRE's report through the API server: exit %d\n%s", code, out)
	}
	m := l.metrics(t)
	if m[`proxyaudit_http_denied_total{reason="no_token"}`] < 1 || m[`proxyaudit_http_denied_total{reason="forbidden"}`] < 1 {
		t.Errorf("denials not counted: %v", m)
	}
}

// expiredToken is node's collector token as the API server would have
// issued it two hours ago for one hour (see localcluster.Redate). The same
// token re-signed with its expiry ahead must pass a TokenReview, so the
// rejection is the expiry's, not the signature's.
func (l *live) expiredToken(ctx context.Context, t *testing.T, node string) string {
	t.Helper()
	now := time.Now()
	review := func(tok string) authnv1.TokenReviewStatus {
		tr, err := l.c.Client.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{
			Token: tok, Audiences: []string{audience}}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return tr.Status
	}
	valid, err := l.c.Redate(l.tokens[node], now.Add(-time.Minute), now.Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if st := review(valid); !st.Authenticated {
		t.Fatalf("re-signed token with its expiry ahead refused (%s): the re-signing is not the API server's", st.Error)
	}
	expired, err := l.c.Redate(l.tokens[node], now.Add(-2*time.Hour), now.Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	st := review(expired)
	if st.Authenticated {
		t.Fatal("the API server accepts a token that expired an hour ago")
	}
	t.Logf("expired token: the API server says %q", st.Error)
	return expired
}

// revokedToken is a collector token bound to a pod on node that has since
// been deleted: the API server stops honouring it at once, long before it
// expires (expiry itself is at least 10 minutes away).
func (l *live) revokedToken(ctx context.Context, t *testing.T, node string) string {
	t.Helper()
	pod, err := l.c.Client.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "gone-"},
		Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: sa, AutomountServiceAccountToken: new(bool),
			Containers: []corev1.Container{{Name: "c", Image: "none"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tr, err := l.c.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		Audiences: []string{audience}, BoundObjectRef: &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}}},
		metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	zero := int64(0)
	if err := l.c.Client.CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	return tr.Status.Token
}
