package realnodes

import (
	"context"
	"flag"
	"fmt"
	"net"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/image"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// make soak runs the soak for an hour at the chart's default grace; make
// test for a few minutes at a shorter grace (the harder case: entries of
// finished flows outlive it).
var (
	soakFor   = flag.Duration("soak", 3*time.Minute, "how long TestE2ESoakOnRealNodes lives through rollouts before its fault (make soak: 60m)")
	soakGrace = flag.Duration("soak-grace", 10*time.Second, "the chart's grace during the soak (make soak: the chart's default, 30s)")
)

// webCorefile makes CoreDNS a web service: its health plugin answers GET
// /health on 8080 (what the clients call), its ready plugin the probe.
const webCorefile = `.:5353 {
    health :8080
    ready :8181
    whoami
}
`

// A cluster's ordinary life, on real nodes with healthy kube-proxies:
// a Deployment behind a Service, called by its DNS name twice a second
// from every node (a new connection each time, a 3 s timeout, as a
// client with no keep-alive), scaled every 20 s and rolled out every
// 60 s, CoreDNS itself rolled out halfway. Rollouts leave conntrack
// entries DNATed to pods that are gone (a SYN that reached a pod in its
// last moment, connections closed normally, finished DNS lookups), which
// only count down to their timeouts: not one report may carry a finding
// through it (issue #58: 82 % of reports did, before the conntrack
// criterion). Then a fault: one node's kube-proxy frozen while the
// Deployment rolls out is found on that node, and only there. The
// timeline (each node first heard after install, quiet, rollouts,
// requests) is logged.
func TestE2ESoakOnRealNodes(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), *soakFor+20*time.Minute)
	defer cancel()
	waitPods(ctx, t, c, "kube-system", "k8s-app=kube-dns", 1, 2*time.Minute)
	kubeDNS, err := c.Client.CoreV1().Services("kube-system").Get(ctx, "kube-dns", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}

	// The workload.
	const ns = "soak"
	labels := map[string]string{"app": "web"}
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	defer c.Client.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
	if _, err := c.Client.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Data: map[string]string{"Corefile": webCorefile}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.CoreV1().Services(ns).Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec: corev1.ServiceSpec{Selector: labels, Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(8080)}}}},
		metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To(int32(2)),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					Tolerations:                   []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
					TerminationGracePeriodSeconds: ptr.To(int64(5)),
					Containers: []corev1.Container{{
						Name: "web", Image: image.CoreDNSRef, ImagePullPolicy: corev1.PullIfNotPresent,
						Args:           []string{"-conf", "/etc/coredns/Corefile"},
						Ports:          []corev1.ContainerPort{{Name: "http", ContainerPort: 8080, Protocol: corev1.ProtocolTCP}},
						ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/ready", Port: intstr.FromInt32(8181)}}, PeriodSeconds: 2},
						VolumeMounts:   []corev1.VolumeMount{{Name: "config", MountPath: "/etc/coredns", ReadOnly: true}},
					}},
					Volumes: []corev1.Volume{{Name: "config", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
						LocalObjectReference: corev1.LocalObjectReference{Name: "web"}}}}},
				},
			},
		},
	}
	if _, err := c.Client.AppsV1().Deployments(ns).Create(ctx, dep, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitPods(ctx, t, c, ns, "app=web", 2, 3*time.Minute)

	// The chart as a new user installs it, but for the grace.
	installed := time.Now()
	helm(ctx, t, c, "install", "proxyaudit", "charts/proxyaudit", "--namespace", "proxyaudit", "--create-namespace",
		"--set", "grace="+soakGrace.String())
	defer uninstall(t, c)
	helmDone := time.Now()
	firstHeard := map[string]time.Duration{}
	var quiet time.Duration
	for deadline := time.Now().Add(4 * time.Minute); quiet == 0; time.Sleep(time.Second) {
		if time.Now().After(deadline) {
			t.Fatalf("not quiet 4 minutes after helm install; nodes first heard: %v", firstHeard)
		}
		r, _, err := report(ctx, t, c)
		if err != nil {
			continue
		}
		for _, n := range r.Nodes {
			if _, ok := firstHeard[n.Node]; !ok && !n.LastReport.IsZero() {
				firstHeard[n.Node] = time.Since(installed).Round(time.Second)
			}
		}
		if r.Stale == nil && len(r.Nodes) == len(fleet) && inSync(r) == len(fleet) && len(r.Findings) == 0 {
			quiet = time.Since(installed).Round(time.Second)
		}
	}
	t.Logf("install: helm returned after %s; each node first heard after %v; every node in sync, no finding, after %s",
		helmDone.Sub(installed).Round(time.Second), firstHeard, quiet)

	// The clients: every node calls web by its name through kube-dns,
	// from its own network namespace, through its kube-proxy's rules.
	var ok, failed atomic.Int64
	clientCtx, stopClients := context.WithCancel(ctx)
	var clients sync.WaitGroup
	defer func() { stopClients(); clients.Wait() }()
	for _, s := range fleet {
		node := c.Node(s.Name)
		dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
			var conn net.Conn
			err := localcluster.InNetNS(node.NetNS, func() error {
				var err error
				conn, err = (&net.Dialer{Timeout: 3 * time.Second}).DialContext(ctx, network, addr)
				return err
			})
			return conn, err
		}
		resolver := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return dial(ctx, network, net.JoinHostPort(kubeDNS.Spec.ClusterIP, "53"))
		}}
		hc := &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{DisableKeepAlives: true,
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				host, port, _ := net.SplitHostPort(addr)
				ips, err := resolver.LookupIP(ctx, "ip4", host)
				if err != nil || len(ips) == 0 {
					return nil, fmt.Errorf("resolve %s: %v", host, err)
				}
				return dial(ctx, network, net.JoinHostPort(ips[0].String(), port))
			}}}
		clients.Go(func() {
			for clientCtx.Err() == nil {
				resp, err := hc.Get("http://web.soak.svc.cluster.local./health")
				if err == nil {
					resp.Body.Close()
				}
				if err == nil && resp.StatusCode == http.StatusOK {
					ok.Add(1)
				} else {
					failed.Add(1)
				}
				select {
				case <-clientCtx.Done():
				case <-time.After(500 * time.Millisecond):
				}
			}
		})
	}

	// The watch: every report of the soak, every finding in it.
	type seen struct {
		first time.Time
		count int
		f     audit.TimedFinding
	}
	var mu sync.Mutex
	findings := map[string]*seen{}
	var reports, withFindings, failedReports int
	watchCtx, stopWatch := context.WithCancel(ctx)
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for watchCtx.Err() == nil {
			r, _, err := report(watchCtx, t, c)
			mu.Lock()
			switch {
			case err != nil:
				if watchCtx.Err() == nil {
					failedReports++
				}
			default:
				reports++
				if len(r.Findings) > 0 {
					withFindings++
				}
				for _, f := range r.Findings {
					k := fmt.Sprintf("%s %s %s %s", f.Kind, f.Node, f.Service, f.Endpoint)
					if findings[k] == nil {
						findings[k] = &seen{first: time.Now(), f: f}
					}
					findings[k].count++
				}
			}
			mu.Unlock()
			select {
			case <-watchCtx.Done():
			case <-time.After(2 * time.Second):
			}
		}
	}()

	// Ordinary life: scaled every 20 s, rolled out every 60 s, CoreDNS
	// rolled out halfway.
	rollout := func(namespace, name string) {
		patch := fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"soak/restarted":%q}}}}}`, time.Now().Format(time.RFC3339Nano))
		if _, err := c.Client.AppsV1().Deployments(namespace).Patch(ctx, name, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			t.Errorf("roll %s/%s out: %v", namespace, name, err)
		}
	}
	scales, rollouts, dnsRollouts := 0, 0, 0
	sizes := []int32{3, 4, 3, 2}
	began := time.Now()
	for tick := 1; time.Since(began) < *soakFor; tick++ {
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(time.Until(began.Add(time.Duration(tick) * 20 * time.Second))):
		}
		if tick%3 == 0 {
			rollout(ns, "web")
			rollouts++
		} else {
			patch := fmt.Sprintf(`{"spec":{"replicas":%d}}`, sizes[scales%len(sizes)])
			if _, err := c.Client.AppsV1().Deployments(ns).Patch(ctx, "web", types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
				t.Errorf("scale web: %v", err)
			}
			scales++
		}
		if dnsRollouts == 0 && time.Since(began) >= *soakFor/2 {
			rollout("kube-system", "coredns")
			dnsRollouts++
		}
	}
	// The last rollout's entries counted down past grace too.
	time.Sleep(*soakGrace + 10*time.Second)
	stopWatch()
	<-watched
	mu.Lock()
	t.Logf("soak: %s (grace %s): %d scales, %d rollouts of web, %d of CoreDNS; %d requests answered, %d failed; %d reports, %d with a finding, %d reports not read",
		time.Since(began).Round(time.Second), *soakGrace, scales, rollouts, dnsRollouts, ok.Load(), failed.Load(), reports, withFindings, failedReports)
	var keys []string
	for k := range findings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		s := findings[k]
		t.Errorf("false finding in %d reports from %s into the soak: %s %s %s %s: %s", s.count, s.first.Sub(began).Round(time.Second),
			s.f.Kind, s.f.Node, s.f.Service, s.f.Endpoint, s.f.Detail)
	}
	mu.Unlock()
	if reports < int(*soakFor/(4*time.Second)) {
		t.Errorf("only %d reports read in %s: the soak watched too little to prove silence", reports, *soakFor)
	}
	if ok.Load() == 0 || failed.Load() > ok.Load()/10 {
		t.Errorf("the clients: %d answered, %d failed: the workload is not what a healthy cluster serves", ok.Load(), failed.Load())
	}

	// The fault: one node's kube-proxy frozen while web rolls out.
	stuck := c.Node("real-ipt-b")
	thaw, err := stuck.Freeze(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer thaw(context.Background())
	frozen := time.Now()
	rollout(ns, "web")
	var found []audit.TimedFinding
	for deadline := time.Now().Add(*soakGrace + 90*time.Second); ; time.Sleep(time.Second) {
		r, raw, err := report(ctx, t, c)
		if err == nil && len(r.Findings) > 0 {
			var elsewhere []string
			found = found[:0]
			for _, f := range r.Findings {
				if f.Node == stuck.Name {
					found = append(found, f)
				} else {
					elsewhere = append(elsewhere, fmt.Sprintf("%s %s %s", f.Kind, f.Node, f.Service))
				}
			}
			if len(elsewhere) > 0 {
				t.Fatalf("findings on nodes whose kube-proxy is healthy: %v", elsewhere)
			}
			if slices.ContainsFunc(found, func(f audit.TimedFinding) bool { return f.Service == ns+"/web" }) {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the frozen kube-proxy on %s was not found within %s; last report:\n%s", stuck.Name, time.Since(frozen).Round(time.Second), clip(raw))
		}
	}
	var kinds []string
	for _, f := range found {
		kinds = append(kinds, string(f.Kind)+" "+f.Service+" "+f.Endpoint)
	}
	t.Logf("fault: %s's kube-proxy frozen, web rolled out; found %s later on that node alone: %s", stuck.Name,
		time.Since(frozen).Round(time.Second), strings.Join(kinds, "; "))
	if err := thaw(ctx); err != nil {
		t.Fatal(err)
	}
	if p := kubeProxyPod(ctx, t, c, stuck.Name); p != nil {
		if err := c.Client.CoreV1().Pods("kube-system").Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	stopClients()
	clients.Wait()
	waitInSync(ctx, t, c, 3*time.Minute, time.Now(), "after the frozen kube-proxy was restarted")
}
