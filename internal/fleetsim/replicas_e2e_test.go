package fleetsim_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/fleetsim"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/shard"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

// The collectors' identity, as the chart makes it: a ServiceAccount and a
// DaemonSet in proxyaudit's namespace (no controller manager runs here:
// the pods are made as its DaemonSet controller would, see
// localcluster.DaemonSetPodToken).
const (
	fleetNS       = "proxyaudit-fleet"
	collectorName = "proxyaudit-collector"
	audience      = "proxyaudit"
)

func setupIdentity(ctx context.Context, t *testing.T, c *localcluster.Cluster) {
	t.Helper()
	if err := c.EnsureNamespace(ctx, fleetNS); err != nil {
		t.Fatal(err)
	}
	_, err := c.Client.CoreV1().ServiceAccounts(fleetNS).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: collectorName}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	labels := map[string]string{"app.kubernetes.io/name": "proxyaudit", "app.kubernetes.io/component": "collector"}
	no := false
	_, err = c.Client.AppsV1().DaemonSets(fleetNS).Create(ctx, &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: collectorName},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{ServiceAccountName: collectorName, HostNetwork: true, AutomountServiceAccountToken: &no,
					Containers: []corev1.Container{{Name: "collector", Image: "proxyaudit:fleetsim", Args: []string{"proxyaudit-collector"}}}},
			},
		},
	}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
}

// tokens issues each named node's collector pod and its projected token,
// workers at a time.
func tokens(ctx context.Context, c *localcluster.Cluster, names []string, workers int) ([]string, error) {
	out := make([]string, len(names))
	errs := make([]error, len(names))
	var wg sync.WaitGroup
	next := make(chan int)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				out[i], errs[i] = c.DaemonSetPodToken(ctx, fleetNS, collectorName, names[i], audience)
			}
		}()
	}
	for i := range names {
		next <- i
	}
	close(next)
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	return out, nil
}

// replicas are aggregator processes, each on a loopback address of its
// own (as pods have their own IPs) with the same ports, so a follower
// proxies the API to the leader as in a cluster.
type replicas struct {
	t                    *testing.T
	c                    *localcluster.Cluster
	bin                  string
	args                 []string
	streamPort, httpPort string
	// internalPort is the replicas' internal API's, when sharded over TLS.
	internalPort string
	procs        map[string]*localcluster.Process // by IP
}

var replicaIPs = []string{"127.0.1.1", "127.0.1.2", "127.0.1.3", "127.0.1.4", "127.0.1.5", "127.0.1.6", "127.0.1.7", "127.0.1.8"}

func startReplicas(t *testing.T, c *localcluster.Cluster, bin string, n int, args ...string) *replicas {
	r := &replicas{t: t, c: c, bin: bin, args: args, procs: map[string]*localcluster.Process{}}
	r.streamPort, r.httpPort = freePort(t, replicaIPs[:n]), freePort(t, replicaIPs[:n])
	if slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, "--peer-token-file=") }) {
		r.internalPort = freePort(t, replicaIPs[:n])
	}
	for _, ip := range replicaIPs[:n] {
		r.start(ip)
	}
	return r
}

func (r *replicas) start(ip string) {
	p, err := r.c.StartProcess("fleet-aggregator-"+ip, append([]string{r.bin,
		"--stream-listen=" + net.JoinHostPort(ip, r.streamPort), "--http-listen=" + net.JoinHostPort(ip, r.httpPort),
		"--advertise-address=" + ip, "--debug-pprof-listen=" + net.JoinHostPort(ip, "6061")}, r.ownArgs(ip)...)...)
	if err != nil {
		r.t.Fatal(err)
	}
	r.procs[ip] = p
}

// ownArgs are the replica's arguments: its internal API on its own
// address when sharded over TLS.
func (r *replicas) ownArgs(ip string) []string {
	if r.internalPort == "" {
		return r.args
	}
	return append(slices.Clone(r.args), "--internal-listen="+net.JoinHostPort(ip, r.internalPort))
}

// aggregatorName is the replicas' ServiceAccount when sharded over TLS, and
// the name of their Service (as the chart's).
const aggregatorName = "proxyaudit-aggregator"

// setupTLSReplicas makes the replicas as the chart runs them when they
// share the fleet: as one ServiceAccount (a kubeconfig impersonating it,
// bound to cluster-admin: the chart's RBAC is not what is measured), their
// stream and internal API over TLS with the pair the first replica makes
// in a Secret, and a token for the peers' audience. It returns their
// arguments; the fleet's TLS needs the Secret, and streamTLS reads it once
// a replica made it.
func setupTLSReplicas(ctx context.Context, t *testing.T, c *localcluster.Cluster) []string {
	t.Helper()
	_, err := c.Client.CoreV1().ServiceAccounts(fleetNS).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: aggregatorName}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	_, err = c.Client.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "fleetsim-" + aggregatorName},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "cluster-admin"},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: aggregatorName, Namespace: fleetNS}}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	dir := t.TempDir()
	kc := filepath.Join(dir, "kubeconfig")
	if err := c.ImpersonatingKubeconfig("system:serviceaccount:"+fleetNS+":"+aggregatorName, kc); err != nil {
		t.Fatal(err)
	}
	tr, err := c.Client.CoreV1().ServiceAccounts(fleetNS).CreateToken(ctx, aggregatorName, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		Audiences: []string{auth.DefaultPeerAudience}, ExpirationSeconds: ptr(int64(3 * 3600))}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tokenFile := filepath.Join(dir, "peers-token")
	if err := os.WriteFile(tokenFile, []byte(tr.Status.Token), 0o600); err != nil {
		t.Fatal(err)
	}
	// A Secret of an earlier run holds a pair for the same names; it is
	// kept (as a chart upgrade keeps it).
	svc := aggregatorName + "." + fleetNS + ".svc"
	peers := aggregatorName + "-headless." + fleetNS + ".svc"
	return []string{"--kubeconfig=" + kc, "--tls-secret=" + aggregatorName + "-tls", "--tls-server-names=" + svc + "," + peers,
		"--peers-service=" + fleetNS + "/" + aggregatorName + "-headless", "--peer-token-file=" + tokenFile}
}

// streamTLS is the fleet's TLS for the replicas' streams: the CA of the
// Secret the first replica made.
func streamTLS(ctx context.Context, t *testing.T, c *localcluster.Cluster) *tls.Config {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(time.Second) {
		sec, err := c.Client.CoreV1().Secrets(fleetNS).Get(ctx, aggregatorName+"-tls", metav1.GetOptions{})
		if err == nil {
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(sec.Data["ca.crt"]) {
				t.Fatal("the replicas' TLS Secret holds no CA")
			}
			return &tls.Config{RootCAs: pool, ServerName: aggregatorName + "." + fleetNS + ".svc", MinVersion: tls.VersionTLS12}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the replicas made no TLS Secret in 2 minutes: %v", err)
		}
	}
}

func ptr[T any](v T) *T { return &v }

// streams are the replicas' stream addresses.
func (r *replicas) streams() []string {
	var out []string
	for _, ip := range replicaIPs[:len(r.procs)] {
		out = append(out, net.JoinHostPort(ip, r.streamPort))
	}
	return out
}

// api is a client of the replica at ip (a follower proxies to the leader).
func (r *replicas) api(ip string) *apiClient {
	return &apiClient{base: "http://" + net.JoinHostPort(ip, r.httpPort)}
}

// leader is the IP of the replica holding the Lease ("" if none).
func (r *replicas) leader(ctx context.Context) string {
	l, err := r.c.Client.CoordinationV1().Leases(fleetNS).Get(ctx, "proxyaudit-aggregator", metav1.GetOptions{})
	if err != nil || l.Spec.HolderIdentity == nil {
		return ""
	}
	host, _, _ := net.SplitHostPort(*l.Spec.HolderIdentity)
	if p := r.procs[host]; p == nil || p.Exited() {
		return ""
	}
	return host
}

// shardsOf are the shards the replica at ip holds, as their Leases say.
func (r *replicas) shardsOf(ctx context.Context, ip string) map[int]bool {
	leases, err := r.c.Client.CoordinationV1().Leases(fleetNS).List(ctx, metav1.ListOptions{LabelSelector: shard.LabelKind + "=shard"})
	if err != nil {
		r.t.Fatal(err)
	}
	out := map[int]bool{}
	for _, l := range leases.Items {
		if l.Spec.HolderIdentity == nil {
			continue
		}
		if host, _, _ := net.SplitHostPort(*l.Spec.HolderIdentity); host == ip {
			k, err := strconv.Atoi(l.Labels[shard.LabelShard])
			if err == nil {
				out[k] = true
			}
		}
	}
	return out
}

// stats reads every live replica's CPU time and memory, by IP.
func (r *replicas) stats() map[string]localcluster.ProcStat {
	out := map[string]localcluster.ProcStat{}
	for ip, p := range r.procs {
		if p.Exited() {
			continue
		}
		if st, err := localcluster.ReadProcStat(p.PID()); err == nil {
			out[ip] = st
		}
	}
	return out
}

func (r *replicas) stop() {
	for ip, p := range r.procs {
		if r.t.Failed() {
			r.t.Logf("aggregator %s log tail:\n%s", ip, p.Tail(30))
		}
		p.Stop()
	}
}

// heapAfterGC is the live heap of the replica at ip, read after a
// collection (Go's heap profile runs one and prints MemStats).
func (r *replicas) heapAfterGC(ip string) (int64, error) {
	resp, err := http.Get("http://" + net.JoinHostPort(ip, "6061") + "/debug/pprof/heap?debug=1&gc=1")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "# HeapAlloc = "); ok {
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, fmt.Errorf("no HeapAlloc in the heap profile of %s", ip)
}

// saveHeapProfile writes the heap profile of the replica at ip (after a
// collection) to $PROXYAUDIT_FLEET_PROFILES/heap-<name>.prof when that is
// set, for `go tool pprof -base` between two moments of a run.
func (r *replicas) saveHeapProfile(ip, name string) {
	dir := os.Getenv("PROXYAUDIT_FLEET_PROFILES")
	if dir == "" {
		return
	}
	resp, err := http.Get("http://" + net.JoinHostPort(ip, "6061") + "/debug/pprof/heap?gc=1")
	if err != nil {
		r.t.Logf("heap profile of %s: %v", ip, err)
		return
	}
	defer resp.Body.Close()
	f, err := os.Create(filepath.Join(dir, "heap-"+name+".prof"))
	if err == nil {
		_, err = io.Copy(f, resp.Body)
		f.Close()
	}
	if err != nil {
		r.t.Logf("heap profile of %s: %v", ip, err)
	}
}

// freePort is a TCP port free on every one of ips.
func freePort(t *testing.T, ips []string) string {
	for range 20 {
		ln, err := net.Listen("tcp", net.JoinHostPort(ips[0], "0"))
		if err != nil {
			t.Fatal(err)
		}
		_, port, _ := net.SplitHostPort(ln.Addr().String())
		free := true
		for _, ip := range ips[1:] {
			l2, err := net.Listen("tcp", net.JoinHostPort(ip, port))
			if err != nil {
				free = false
				break
			}
			l2.Close()
		}
		ln.Close()
		if free {
			return port
		}
	}
	t.Fatal("no port free on every replica address")
	return ""
}

// tokenReviews is how many TokenReviews the API server has served
// (apiserver_request_total, every code).
func tokenReviews(ctx context.Context, client kubernetes.Interface) (float64, error) {
	raw, err := client.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		return 0, fmt.Errorf("the API server's metrics: %w", err)
	}
	var sum float64
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "apiserver_request_total{") || !strings.Contains(line, `resource="tokenreviews"`) {
			continue
		}
		v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err != nil {
			return 0, fmt.Errorf("apiserver_request_total: %q: %w", line, err)
		}
		sum += v
	}
	return sum, nil
}

// waitLeader waits for a live replica to hold the Lease.
func (r *replicas) waitLeader(ctx context.Context, d time.Duration) string {
	r.t.Helper()
	var ip string
	testkit.Eventually(r.t, d, "an aggregator leading", func() bool {
		ip = r.leader(ctx)
		return ip != "" && r.api(ip).ready()
	})
	return ip
}

// replaceNodes replaces R nodes of the fleet, rate a second, as an
// autoscaler does: a new node joins (its collector pod and token made),
// the old one's collector goes and its Node is deleted. After each half
// the leader must list exactly the fleet (departed nodes forgotten) and
// its live heap after the second half must not have grown beyond noise:
// node churn may not grow the leader.
func replaceNodes(ctx context.Context, t *testing.T, c *localcluster.Cluster, client kubernetes.Interface, fleet *fleetsim.Fleet, reps *replicas, leader string,
	res *Result, n, R int, rate float64, check func(nodes bool) audit.Verdict) {
	tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer tick.Stop()
	gen := 0
	departed := map[string]bool{}
	half := func(k int) float64 {
		start := time.Now()
		for range k {
			<-tick.C
			i := gen * 7919 % n
			gen++
			old := fleet.Name(i)
			name := fmt.Sprintf("sim-%05d-r%d", i, gen)
			if err := fleetsim.CreateNode(ctx, client, name, i); err != nil {
				t.Fatal(err)
			}
			tok := ""
			if res.Auth {
				var err error
				if tok, err = c.DaemonSetPodToken(ctx, fleetNS, collectorName, name, audience); err != nil {
					t.Fatal(err)
				}
			}
			fleet.Replace(i, name, tok)
			zero := int64(0)
			if err := client.CoreV1().Pods(fleetNS).Delete(ctx, collectorName+"-"+old, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil && !apierrors.IsNotFound(err) {
				t.Fatal(err)
			}
			if err := client.CoreV1().Nodes().Delete(ctx, old, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
			departed[old] = true
			if gen%10 == 0 {
				check(false)
			}
		}
		t.Logf("%d nodes replaced in %s", k, time.Since(start).Round(time.Second))
		// Departed nodes are forgotten once silent past their allowance
		// (three intervals); the new ones report.
		testkit.Eventually(t, 2*time.Minute, "the leader listing exactly the fleet", func() bool {
			v := check(true)
			// Under churn a healthy node is in sync or a change behind.
			ghosts, healthy := 0, 0
			for _, s := range v.Nodes {
				if departed[s.Node] {
					ghosts++
				}
				if s.State == audit.NodeInSync || s.State == audit.NodeLagging {
					healthy++
				}
			}
			res.Ghosts = ghosts
			return ghosts == 0 && len(v.Nodes) == n && healthy == n
		})
		h, err := reps.heapAfterGC(leader)
		if err != nil {
			t.Fatal(err)
		}
		reps.saveHeapProfile(leader, fmt.Sprintf("after-%d-replacements", gen))
		return float64(h) / 1e6
	}
	// A first round fills what churn fills once (maps at their size,
	// pools); the second must add nothing.
	res.HeapAfterHalfMB = half(R / 2)
	res.HeapAfterAllMB = half(R - R/2)
	res.Replacements = R
	t.Logf("%d node replacements: the leader's live heap %.1f MB after the first half, %.1f MB after the second", R, res.HeapAfterHalfMB, res.HeapAfterAllMB)
	if grow := res.HeapAfterAllMB - res.HeapAfterHalfMB; grow > max(4, 0.1*res.HeapAfterHalfMB) {
		t.Errorf("the leader's live heap grew %.1f MB over %d node replacements (%.1f → %.1f MB): node churn grows it", grow, R-R/2, res.HeapAfterHalfMB, res.HeapAfterAllMB)
	}
}
