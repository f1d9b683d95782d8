package realnodes

import (
	"context"
	"flag"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
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
	soakFor    = flag.Duration("soak", 6*time.Minute, "how long TestE2ESoakOnRealNodes lives through rollouts and faults, one every max(1m, soak/12) (make soak: 60m)")
	soakGrace  = flag.Duration("soak-grace", 10*time.Second, "the chart's grace during the soak (make soak: the chart's default, 30s)")
	soakFaults = flag.String("soak-faults", "", "the faults the soak injects, in turn, comma-separated (empty: frozen, watch hung, watch hung for good, flushed, endpoint rewritten and UDP blackhole, shuffled)")
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
// client with no keep-alive), with a keep-alive client (one long-lived
// TCP connection a node), a UDP client asking its DNS port from one
// socket on every node, and a client outside the nodes calling its
// NodePort on each node in turn; scaled every 20 s and rolled out every
// 60 s, its pods killed, Services made and deleted, an aggregator pod
// killed (at 3/4 of a short soak, every 15 minutes of a long one),
// CoreDNS itself rolled out halfway; kube-proxy's DaemonSets rolled, the
// API server restarted once, the chart upgraded, a node drained and
// uncordoned (each first at a share of a short soak, then every 20
// minutes; kube-proxy's roll never while a fault is out, as it would
// heal it). Rollouts leave conntrack
// entries DNATed to pods that are gone (a SYN that reached a pod in its
// last moment, connections closed normally, finished DNS lookups), which
// only count down to their timeouts: not one report may carry a finding
// through it (issue #58: 82 % of reports did, before the conntrack
// criterion). Remediation is on (restart, default budgets). Faults come
// at jittered times on random nodes, one at a time: kube-proxy frozen,
// its watch hung while its metrics answer (its connection dropped, which
// client-go may replace by itself, or hung for good: the seed's case), its
// NAT rules flushed, one endpoint's DNAT rewritten by hand, or a UDP
// client sending to a service whose pod went (a blackhole kube-proxy
// leaves); each
// must be found on its node and repaired (kube-proxy restarted) or paged
// (then healed by hand as the page says); a finding, a restart or a page
// not explained by a fault fails the soak. The timeline (install, rollouts,
// faults, findings, repairs) and the times to find, repair and heal are
// logged.
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
	// web answers HTTP and, on UDP, DNS (CoreDNS's whoami); a NodePort
	// for the client outside the nodes.
	webSvc, err := c.Client.CoreV1().Services(ns).Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec: corev1.ServiceSpec{Selector: labels, Type: corev1.ServiceTypeNodePort, Ports: []corev1.ServicePort{
			{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(8080)},
			{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP, TargetPort: intstr.FromInt32(5353)}}}},
		metav1.CreateOptions{})
	if err != nil {
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
						Args: []string{"-conf", "/etc/coredns/Corefile"},
						Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080, Protocol: corev1.ProtocolTCP},
							{Name: "dns", ContainerPort: 5353, Protocol: corev1.ProtocolUDP}},
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

	// The chart as a new user installs it, but for the grace, remediation
	// on, and one node at a time (the default 10% is none under ten
	// nodes; the breaker's 10% an hour still allows one restart an hour
	// here: the other faults are paged, and healed by hand as the page
	// says).
	installed := time.Now()
	helm(ctx, t, c, "install", "proxyaudit", "charts/proxyaudit", "--namespace", "proxyaudit", "--create-namespace",
		"--set", "grace="+soakGrace.String(), "--set", "remediation.mode=restart", "--set", "remediation.maxUnhealthy=1")
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

	// Beside them, the traffic that outlives a pod: on every node a
	// keep-alive HTTP client (one TCP connection reused until its pod
	// goes) and a UDP client asking web's DNS port from one socket (one
	// conntrack entry, re-pointed by kube-proxy when its pod leaves); and
	// from this host, outside the nodes, a client calling web's NodePort
	// on each node in turn.
	var keptOK, keptFailed, keptConns, nodePortOK, nodePortFailed atomic.Int64
	var udp []*resolver
	for _, s := range fleet {
		node := c.Node(s.Name)
		udp = append(udp, startResolver(t, node, webSvc.Spec.ClusterIP))
		hc := &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 1, IdleConnTimeout: time.Hour,
			DialContext: func(ctx context.Context, network, addr string) (conn net.Conn, err error) {
				keptConns.Add(1)
				err = localcluster.InNetNS(node.NetNS, func() error {
					conn, err = (&net.Dialer{Timeout: 3 * time.Second}).DialContext(ctx, network, addr)
					return err
				})
				return conn, err
			}}}
		clients.Go(func() {
			defer hc.CloseIdleConnections()
			for clientCtx.Err() == nil {
				resp, err := hc.Get("http://" + net.JoinHostPort(webSvc.Spec.ClusterIP, "80") + "/health")
				if err == nil {
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
				if err == nil && resp.StatusCode == http.StatusOK {
					keptOK.Add(1)
				} else {
					keptFailed.Add(1)
				}
				select {
				case <-clientCtx.Done():
				case <-time.After(500 * time.Millisecond):
				}
			}
		})
	}
	nodePort := webSvc.Spec.Ports[0].NodePort
	outside := &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	clients.Go(func() {
		for i := 0; clientCtx.Err() == nil; i++ {
			node := c.Node(fleet[i%len(fleet)].Name)
			resp, err := outside.Get(fmt.Sprintf("http://%s/health", net.JoinHostPort(node.IP, strconv.Itoa(int(nodePort)))))
			if err == nil {
				resp.Body.Close()
			}
			if err == nil && resp.StatusCode == http.StatusOK {
				nodePortOK.Add(1)
			} else {
				nodePortFailed.Add(1)
			}
			select {
			case <-clientCtx.Done():
			case <-time.After(250 * time.Millisecond):
			}
		}
	})

	// The watch: every report of the soak, every finding in it, and
	// every kube-proxy pod replaced (a repair). A finding or a repair on
	// a node is explained by a fault injected there, from its injection
	// until a grace and 30 s after it healed; anything else is false.
	type seen struct {
		first time.Time
		count int
		f     audit.TimedFinding
	}
	var mu sync.Mutex
	var faults []*soakFault
	faultOn := func(node string, now time.Time) *soakFault {
		for _, f := range slices.Backward(faults) {
			if f.node == node && !now.Before(f.at) && (f.healed.IsZero() || now.Before(f.healed.Add(*soakGrace+30*time.Second))) {
				return f
			}
		}
		return nil
	}
	var timeline []string
	began := time.Now()
	event := func(format string, args ...any) { // mu held
		timeline = append(timeline, fmt.Sprintf("+%s ", time.Since(began).Round(time.Second))+fmt.Sprintf(format, args...))
	}
	findings := map[string]*seen{}
	// falseRepair: a healthy node's kube-proxy pod replaced; who did it
	// is looked up at the end (proxyaudit's Event may come after the pod).
	type falseRepair struct{ what, node string }
	var falseRepairs []falseRepair
	var falsePages []string
	var proxyRolled time.Time // kube-proxy's DaemonSets rolled: its pods replaced for three minutes are no repair
	proxyPods := map[string]types.UID{}
	// Pages the suite's earlier tests made on this cluster are not the
	// soak's (an Event stays an hour).
	pages := map[types.UID]int32{}
	// actedOn: proxyaudit's last action on each node without a fault
	// (its Event's reason and message), to say who replaced a healthy
	// node's kube-proxy and why.
	actedOn := map[string]string{}
	if evs, err := c.Client.CoreV1().Events("default").List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.kind=Node"}); err != nil {
		t.Fatal(err)
	} else {
		for _, e := range evs.Items {
			pages[e.UID] = e.Count
		}
	}
	var reports, withFindings, failedReports int
	watchCtx, stopWatch := context.WithCancel(ctx)
	watched := make(chan struct{})
	procs := map[int]*podProcess{}
	go func() {
		defer close(watched)
		for poll := 0; watchCtx.Err() == nil; poll++ {
			if poll%5 == 0 {
				// The leading aggregator holds the fleet's state a follower
				// does not: its memory is measured from when it leads.
				leader := ""
				if name := leaderPod(watchCtx, c); name != "" {
					if p, err := c.Client.CoreV1().Pods("proxyaudit").Get(watchCtx, name, metav1.GetOptions{}); err == nil {
						leader = string(p.UID)
					}
				}
				sampleProcesses(procs, leader) // only this goroutine writes it until watched closes
			}
			r, _, err := report(watchCtx, t, c)
			pods, perr := c.Client.CoreV1().Pods("kube-system").List(watchCtx, metav1.ListOptions{LabelSelector: "k8s-app=kube-proxy"})
			// proxyaudit's own Events on nodes: a page, or an action taken
			// (its reason names the drift: a repair within a poll of the
			// finding, as a flush is, leaves no report to read it from).
			evs, eerr := c.Client.CoreV1().Events("default").List(watchCtx, metav1.ListOptions{FieldSelector: "involvedObject.kind=Node"})
			now := time.Now()
			mu.Lock()
			if eerr == nil {
				for _, e := range evs.Items {
					if pages[e.UID] == e.Count {
						continue
					}
					pages[e.UID] = e.Count
					switch e.Reason {
					case "ProxyauditRestartProxy", "ProxyauditCordon":
						f := faultOn(e.InvolvedObject.Name, now)
						if f != nil && f.found.IsZero() {
							f.found, f.first = now, audit.TimedFinding{Finding: audit.Finding{Kind: audit.Kind(e.Reason), Node: f.node, Detail: e.Message}}
							event("%s: found (%s: %.100s)", f.node, e.Reason, e.Message)
						}
						if f == nil {
							actedOn[e.InvolvedObject.Name] = fmt.Sprintf("%s at +%s: %.300s", e.Reason, e.LastTimestamp.Sub(began).Round(time.Second), e.Message)
							event("%s: %s on a node without a fault: %.200s", e.InvolvedObject.Name, e.Reason, e.Message)
						}
						continue
					case "ProxyauditPage":
					default:
						continue
					}
					if f := faultOn(e.InvolvedObject.Name, now); f != nil {
						if f.paged.IsZero() {
							f.paged = now
							event("%s: paged: %.100s", f.node, e.Message)
						}
					} else {
						falsePages = append(falsePages, fmt.Sprintf("+%s %s: %.200s", now.Sub(began).Round(time.Second), e.InvolvedObject.Name, e.Message))
					}
				}
			}
			if perr == nil {
				for _, p := range pods.Items {
					if p.DeletionTimestamp != nil || p.Spec.NodeName == "" {
						continue
					}
					if was, ok := proxyPods[p.Spec.NodeName]; ok && was != p.UID {
						if f := faultOn(p.Spec.NodeName, now); f != nil {
							if f.repaired.IsZero() {
								f.repaired = now
								by := "by proxyaudit"
								if !f.byHand.IsZero() {
									by = "by hand, as paged"
								}
								event("%s: kube-proxy pod replaced %s (%s)", f.node, by, p.Name)
							}
						} else if proxyRolled.IsZero() || now.Sub(proxyRolled) > 3*time.Minute {
							falseRepairs = append(falseRepairs, falseRepair{fmt.Sprintf("+%s %s (%s)", now.Sub(began).Round(time.Second), p.Spec.NodeName, p.Name), p.Spec.NodeName})
						}
					}
					proxyPods[p.Spec.NodeName] = p.UID
				}
			}
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
				on := map[string]bool{}
				for _, f := range r.Findings {
					on[f.Node] = true
					if ft := faultOn(f.Node, now); ft != nil {
						// A drift that began before this fault is the last
						// one's tail on the node: explained, but it does not
						// find this one. Nor does a collector not heard:
						// that says nothing of the node's dataplane.
						if ft.found.IsZero() && !f.Since.Before(ft.at.Add(-time.Second)) && f.Kind != audit.CollectorMissing {
							ft.found, ft.first = now, f
							event("%s: found, %s %s %s", ft.node, f.Kind, f.Service, f.Endpoint)
						}
						continue
					}
					// Flows pinned to a pod that left during a fault on
					// their node are that fault's, however late they are
					// reported: a TCP attempt's entries count down for two
					// minutes, and are quiet only once a conntrack read
					// (30 s apart) has seen no packet since the last.
					if f.Kind == audit.StaleConntrack && slices.ContainsFunc(faults, func(g *soakFault) bool {
						return g.node == f.Node && !f.Since.Before(g.at.Add(-time.Second)) && (g.healed.IsZero() || !f.Since.After(g.healed))
					}) {
						continue
					}
					k := fmt.Sprintf("%s %s %s %s", f.Kind, f.Node, f.Service, f.Endpoint)
					if findings[k] == nil {
						findings[k] = &seen{first: now, f: f}
					}
					findings[k].count++
				}
				for _, n := range r.Nodes {
					ft := faultOn(n.Node, now)
					if ft == nil || !ft.healed.IsZero() {
						continue
					}
					// Drift is the rules' past grace (a collector restarted by
					// an upgrade is Pending or Missing a while, a node behind
					// a rollout Lagging: no sign of the fault), and healed is
					// in sync again after it.
					if n.State == audit.NodeDivergent || n.State == audit.NodeStuck || n.State == audit.NodeNoRules || on[n.Node] {
						if ft.drifted.IsZero() {
							ft.drifted = now
						}
					} else if n.State == audit.NodeInSync && !on[n.Node] && n.LastReport.After(ft.at) && (!ft.found.IsZero() || !ft.repaired.IsZero() || !ft.drifted.IsZero()) && n.LastReport.After(ft.repaired) {
						ft.healed = now
						event("%s: in sync again", ft.node)
					}
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
	scales, rollouts, dnsRollouts, killed, services, aggregatorsKilled := 0, 0, 0, 0, 0, 0
	last := ""
	aggregatorKill := time.Now().Add(min(*soakFor*3/4, 15*time.Minute))
	// Heavier churn, first at a share of a short soak, then every 20
	// minutes: kube-proxy's DaemonSets rolled (every kube-proxy pod but
	// the static one replaced), the API server restarted (once), the
	// chart upgraded (every aggregator and collector pod rolled), a node
	// drained and uncordoned.
	at := func(share float64) time.Time {
		return began.Add(min(time.Duration(share*float64(*soakFor)), 10*time.Minute))
	}
	upgrades := 0
	heavy := []*struct {
		name  string
		next  time.Time
		every time.Duration
		do    func() error
		done  int
		quiet bool // only while no fault is out, and none starts for 40 s after
	}{
		{name: "kube-proxy's DaemonSets rolled", next: at(0.3), every: 20 * time.Minute, quiet: true, do: func() error {
			dss, err := c.Client.AppsV1().DaemonSets("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=kube-proxy"})
			if err != nil {
				return err
			}
			mu.Lock()
			proxyRolled = time.Now()
			mu.Unlock()
			patch := fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"soak/restarted":%q}}}}}`, time.Now().Format(time.RFC3339Nano))
			for _, ds := range dss.Items {
				if _, err := c.Client.AppsV1().DaemonSets("kube-system").Patch(ctx, ds.Name, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
					return err
				}
			}
			return nil
		}},
		{name: "the API server restarted", next: at(0.5), every: 1000 * time.Hour, do: func() error {
			start, err := c.StopAPIServer()
			if err != nil {
				return err
			}
			time.Sleep(5 * time.Second)
			return start(ctx)
		}},
		{name: "the chart upgraded (every proxyaudit pod rolled)", next: at(0.65), every: 20 * time.Minute, do: func() error {
			upgrades++
			helm(ctx, t, c, "upgrade", "proxyaudit", "charts/proxyaudit", "--namespace", "proxyaudit", "--reset-then-reuse-values",
				"--set-string", fmt.Sprintf("collector.podAnnotations.soak/upgrade=%d", upgrades),
				"--set-string", fmt.Sprintf("aggregator.podAnnotations.soak/upgrade=%d", upgrades))
			return nil
		}},
		{name: "a node drained and uncordoned", next: at(0.85), every: 20 * time.Minute, do: func() error {
			node := fleet[rand.IntN(len(fleet))].Name
			cordon := func(on bool) error {
				_, err := c.Client.CoreV1().Nodes().Patch(ctx, node, types.StrategicMergePatchType, []byte(fmt.Sprintf(`{"spec":{"unschedulable":%v}}`, on)), metav1.PatchOptions{})
				return err
			}
			if err := cordon(true); err != nil {
				return err
			}
			pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
			if err != nil {
				return err
			}
			for _, p := range pods.Items {
				_ = c.Client.CoreV1().Pods(ns).Delete(ctx, p.Name, metav1.DeleteOptions{})
			}
			time.Sleep(15 * time.Second)
			return cordon(false)
		}},
	}
	sizes := []int32{3, 4, 3, 2}
	// Faults at jittered times on random nodes whose kube-proxy a restart
	// can repair (not the static one), one at a time (the default budget
	// repairs one node at a time): a kube-proxy frozen, a watch hung with
	// its metrics answering (the seed's case), the NAT rules flushed, one
	// endpoint's rule rewritten by hand (of a Service nothing changes, so
	// that kube-proxy does not rewrite it on its own).
	still, err := c.CreateService(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "still", Namespace: ns},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}}})
	if err == nil {
		err = c.ApplySlice(ctx, localcluster.Slice(still, "still-1", "http", 8080, corev1.ProtocolTCP, "198.18.252.1"))
	}
	if err != nil {
		t.Fatal(err)
	}
	// And a real blackhole kube-proxy leaves: a UDP client on the node
	// keeps sending to its node's node port of a service whose one pod
	// went (scaled to zero: kube-proxy's conntrack cleanup skips a node
	// port with no endpoints, 1.37's too; a ClusterIP's 1.37 cleans, see
	// docs/design.md), its entry still DNATed to the gone pod. No restart cures it (the
	// rules are right); the chart's default pages nothing for it (its
	// alert is Prometheus's ProxyAuditStaleConntrack), so the operator
	// scales the service back once it is found.
	lone := dep.DeepCopy()
	lone.Name, lone.Spec.Replicas = "lone", ptr.To(int32(1))
	lone.Spec.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{"app": "lone"}}
	lone.Spec.Template.Labels = map[string]string{"app": "lone"}
	loneSvc, err := c.Client.CoreV1().Services(ns).Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "lone"},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeNodePort, Selector: lone.Spec.Template.Labels, Ports: []corev1.ServicePort{
			{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP, TargetPort: intstr.FromInt32(5353)}}}}, metav1.CreateOptions{})
	if err == nil {
		_, err = c.Client.AppsV1().Deployments(ns).Create(ctx, lone, metav1.CreateOptions{})
	}
	if err != nil {
		t.Fatal(err)
	}
	waitPods(ctx, t, c, ns, "app=lone", 1, 3*time.Minute)
	scaleLone := func(ctx context.Context, n int) error {
		_, err := c.Client.AppsV1().Deployments(ns).Patch(ctx, "lone", types.StrategicMergePatchType, []byte(fmt.Sprintf(`{"spec":{"replicas":%d}}`, n)), metav1.PatchOptions{})
		return err
	}
	// Every kind in turn, shuffled (-soak-faults names some instead).
	kinds := []string{"frozen", "watch hung", "watch hung for good", "flushed", "endpoint rewritten", "UDP blackhole"}
	rand.Shuffle(len(kinds), func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })
	if *soakFaults != "" {
		known := slices.Clone(kinds)
		kinds = strings.Split(*soakFaults, ",")
		for _, k := range kinds {
			if !slices.Contains(known, k) {
				t.Fatalf("-soak-faults: no fault %q (%s)", k, strings.Join(known, ", "))
			}
		}
	}
	every := max(time.Minute, *soakFor/12)
	nextFault := began.Add(every/4 + time.Duration(rand.Int64N(int64(every/8))))
	inject := func() {
		var nodes []*localcluster.Node
		for _, s := range fleet {
			if !s.StaticProxy {
				nodes = append(nodes, c.Node(s.Name))
			}
		}
		n := nodes[rand.IntN(len(nodes))]
		mu.Lock()
		f := &soakFault{kind: kinds[len(faults)%len(kinds)], node: n.Name, at: time.Now()}
		mu.Unlock()
		var err error
		switch f.kind {
		case "frozen":
			f.undo, err = n.Freeze(ctx)
		case "watch hung":
			f.undo, err = n.DropAPIConnection(ctx)
		case "watch hung for good":
			// Until kube-proxy's pod is replaced (a restart, by
			// proxyaudit or by hand): the new container's connections
			// are not matched.
			if f.undo, err = n.HangProxyWatch(ctx); err != nil {
				// No unified cgroup hierarchy on this host: the nearest
				// fault a restart repairs.
				t.Logf("watch hung for good on %s: %v; frozen instead", n.Name, err)
				f.undo, err = n.Freeze(ctx)
			}
		case "flushed":
			err = n.FlushRules(ctx)
		case "endpoint rewritten":
			err = n.TamperEndpoint(ctx, "198.18.252.1:8080", "198.18.252.9:8080")
		case "UDP blackhole":
			r := startResolverAt(t, n, net.JoinHostPort(n.IP, strconv.Itoa(int(loneSvc.Spec.Ports[0].NodePort))))
			for deadline := time.Now().Add(20 * time.Second); r.answers.Load() == 0 && time.Now().Before(deadline); {
				time.Sleep(100 * time.Millisecond)
			}
			if r.answers.Load() == 0 {
				r.stop()
				err = fmt.Errorf("lone does not answer %s's UDP client", n.Name)
				break
			}
			var once sync.Once
			f.undo = func(ctx context.Context) (err error) {
				once.Do(func() { r.stop(); err = scaleLone(ctx, 1) })
				return err
			}
			err = scaleLone(ctx, 0)
		}
		if err != nil {
			t.Errorf("inject %s on %s: %v", f.kind, n.Name, err)
			return
		}
		mu.Lock()
		faults = append(faults, f)
		event("%s: FAULT %s", f.node, f.kind)
		mu.Unlock()
	}
	var busyUntil time.Time // heavy churn: no fault starts before it ends
	active := func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(faults) > 0 && faults[len(faults)-1].healed.IsZero()
	}
	// The operator: a fault paged and not repaired is healed as the page
	// says (kube-proxy's pod deleted).
	operator := func() {
		mu.Lock()
		var f *soakFault
		if len(faults) > 0 {
			last := faults[len(faults)-1]
			switch {
			case !last.healed.IsZero() || !last.repaired.IsZero() || !last.byHand.IsZero():
			case !last.paged.IsZero() && time.Since(last.paged) > 5*time.Second:
				f = last
			case last.kind == "UDP blackhole" && !last.found.IsZero() && time.Since(last.found) > 5*time.Second:
				f = last // alerted, not paged: scaled back by hand
			}
			if f != nil {
				f.byHand = time.Now()
			}
		}
		mu.Unlock()
		if f == nil {
			return
		}
		if f.undo != nil {
			if err := f.undo(ctx); err != nil {
				t.Errorf("undo %s on %s: %v", f.kind, f.node, err)
			}
			f.undo = nil
		}
		if f.kind == "UDP blackhole" {
			return // the service has a pod again: kube-proxy clears the entry
		}
		if p := kubeProxyPod(ctx, t, c, f.node); p != nil {
			if err := c.Client.CoreV1().Pods("kube-system").Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil {
				t.Errorf("delete kube-proxy on %s: %v", f.node, err)
			}
		}
	}
	// A hung watch can come back by itself (client-go's HTTP/2 health
	// check finds the dead connection and kube-proxy opens another), before
	// grace ends: nothing is then wrong long enough to be found. The
	// node's own rules say so, not proxyaudit: every ready endpoint of web
	// programmed there a grace and 30 s after the fault, with no drift
	// seen, is a kube-proxy following the API again; else it is still a
	// fault, and proxyaudit must find it.
	recovered := func() {
		mu.Lock()
		var f *soakFault
		if len(faults) > 0 {
			if last := faults[len(faults)-1]; last.kind == "watch hung" && last.healed.IsZero() && last.found.IsZero() && last.drifted.IsZero() &&
				last.repaired.IsZero() && time.Since(last.at) > *soakGrace+30*time.Second {
				f = last
			}
		}
		mu.Unlock()
		if f == nil {
			return
		}
		n := c.Node(f.node)
		webSlices, err := c.Client.DiscoveryV1().EndpointSlices(ns).List(ctx, metav1.ListOptions{LabelSelector: "kubernetes.io/service-name=web"})
		if err != nil {
			return
		}
		rules, err := n.Rules(ctx)
		if err != nil {
			return
		}
		var eps []string
		for _, sl := range webSlices.Items {
			for _, e := range sl.Endpoints {
				if e.Conditions.Ready != nil && *e.Conditions.Ready {
					for _, a := range e.Addresses {
						eps = append(eps, net.JoinHostPort(a, "8080"))
					}
				}
			}
		}
		for _, ep := range eps {
			if !n.RoutesTo(rules, ep) {
				return
			}
		}
		if len(eps) == 0 {
			return
		}
		mu.Lock()
		f.healed, f.selfHealed = time.Now(), true
		event("%s: kube-proxy follows the API again by itself (its rules route to web's %d ready endpoints), no drift seen: nothing to find", f.node, len(eps))
		mu.Unlock()
	}
	for tick := 1; time.Since(began) < *soakFor; tick++ {
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(time.Until(began.Add(time.Duration(tick) * 20 * time.Second))):
		}
		if tick%3 == 0 {
			rollout(ns, "web")
			rollouts++
			mu.Lock()
			event("web rolled out")
			mu.Unlock()
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
		// Beside them: a web pod killed, a Service of its own (no
		// selector, its slice written here) made and the last one deleted,
		// and an aggregator replica killed now and then (the Lease moves or
		// not; the streams reconnect).
		switch tick % 3 {
		case 1:
			if pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=web"}); err == nil && len(pods.Items) > 0 {
				p := pods.Items[rand.IntN(len(pods.Items))]
				if err := c.Client.CoreV1().Pods(ns).Delete(ctx, p.Name, metav1.DeleteOptions{}); err == nil {
					killed++
				}
			}
		case 2:
			name := fmt.Sprintf("churn-%d", tick)
			svc, err := c.CreateService(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
				Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}}})
			if err == nil {
				err = c.ApplySlice(ctx, localcluster.Slice(svc, name+"-1", "http", 8080, corev1.ProtocolTCP, fmt.Sprintf("198.18.251.%d", 1+tick%250)))
			}
			if err != nil {
				t.Errorf("service %s: %v", name, err)
			}
			if last != "" {
				_ = c.Client.DiscoveryV1().EndpointSlices(ns).Delete(ctx, last+"-1", metav1.DeleteOptions{})
				if err := c.Client.CoreV1().Services(ns).Delete(ctx, last, metav1.DeleteOptions{}); err != nil {
					t.Errorf("delete service %s: %v", last, err)
				}
			}
			last = name
			services++
		}
		for _, ch := range heavy {
			if time.Now().Before(ch.next) || ch.quiet && active() {
				continue // a kube-proxy roll would heal the fault out
			}
			mu.Lock()
			event("%s", ch.name)
			mu.Unlock()
			if err := ch.do(); err != nil {
				t.Errorf("%s: %v", ch.name, err)
			}
			ch.done++
			// No fault starts for 40 s after any of them: a fault on a node
			// whose collector an upgrade is restarting blinds it (it finds
			// the aggregator through the node's own service rules: a
			// flushed table left it CollectorMissing, never paged).
			ch.next, busyUntil = time.Now().Add(ch.every), time.Now().Add(40*time.Second)
		}
		if time.Now().After(aggregatorKill) {
			if pods, err := c.Client.CoreV1().Pods("proxyaudit").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=aggregator"}); err == nil && len(pods.Items) > 0 {
				p := pods.Items[rand.IntN(len(pods.Items))]
				leads := p.Name == leaderPod(ctx, c)
				if err := c.Client.CoreV1().Pods("proxyaudit").Delete(ctx, p.Name, metav1.DeleteOptions{}); err == nil {
					mu.Lock()
					event("aggregator pod %s killed (leader: %v)", p.Name, leads)
					mu.Unlock()
					aggregatorsKilled++
				}
			}
			aggregatorKill = time.Now().Add(15 * time.Minute)
		}
		operator()
		recovered()
		if time.Now().After(nextFault) && time.Now().After(busyUntil) && !active() {
			inject()
			nextFault = time.Now().Add(every + time.Duration(rand.Int64N(int64(every/4))))
		}
	}
	// The last fault healed, the last rollout's entries counted down past
	// grace.
	for deadline := time.Now().Add(3 * time.Minute); active(); time.Sleep(time.Second) {
		operator()
		recovered()
		if time.Now().After(deadline) {
			// Healed as the page would say, so that the suite's later
			// tests find a healthy cluster.
			mu.Lock()
			last := faults[len(faults)-1]
			mu.Unlock()
			if p := kubeProxyPod(ctx, t, c, last.node); p != nil {
				_ = c.Client.CoreV1().Pods("kube-system").Delete(ctx, p.Name, metav1.DeleteOptions{})
			}
		}
		if time.Now().After(deadline) {
			mu.Lock()
			t.Errorf("the last fault did not heal within 3 minutes of the soak's end; timeline:\n  %s", strings.Join(timeline, "\n  "))
			mu.Unlock()
			break
		}
	}
	time.Sleep(*soakGrace + 10*time.Second)
	stopWatch()
	<-watched
	stopClients()
	clients.Wait()
	mu.Lock()
	defer mu.Unlock()
	for _, f := range faults {
		if f.undo != nil {
			if err := f.undo(ctx); err != nil {
				t.Errorf("undo %s on %s: %v", f.kind, f.node, err)
			}
		}
	}
	t.Logf("soak timeline:\n  %s", strings.Join(timeline, "\n  "))
	var toFind, toRepair, toHeal []time.Duration
	selfHealed := 0
	for _, f := range faults {
		line := fmt.Sprintf("fault %s on %s at +%s:", f.kind, f.node, f.at.Sub(began).Round(time.Second))
		if f.found.IsZero() && f.selfHealed {
			t.Logf("%s kube-proxy recovered by itself within %s, before grace: not a finding", line, f.healed.Sub(f.at).Round(time.Second))
			selfHealed++
			continue
		}
		if f.found.IsZero() {
			t.Errorf("%s never found (healed %v, kube-proxy pod replaced %v)", line, !f.healed.IsZero(), !f.repaired.IsZero())
			continue
		}
		toFind = append(toFind, f.found.Sub(f.at))
		line += fmt.Sprintf(" found after %s (%s %s)", f.found.Sub(f.at).Round(time.Second), f.first.Kind, f.first.Service)
		if !f.paged.IsZero() {
			line += fmt.Sprintf(", paged after %s", f.paged.Sub(f.at).Round(time.Second))
		}
		switch {
		case !f.repaired.IsZero() && f.byHand.IsZero():
			toRepair = append(toRepair, f.repaired.Sub(f.at))
			line += fmt.Sprintf(", kube-proxy restarted by proxyaudit after %s", f.repaired.Sub(f.at).Round(time.Second))
		case !f.byHand.IsZero():
			line += fmt.Sprintf(", healed by hand after %s", f.byHand.Sub(f.at).Round(time.Second))
		}
		if f.repaired.IsZero() && f.paged.IsZero() && f.healed.IsZero() {
			t.Errorf("%s found but neither repaired nor paged", line)
		}
		if !f.healed.IsZero() {
			toHeal = append(toHeal, f.healed.Sub(f.at))
			line += fmt.Sprintf(", in sync after %s", f.healed.Sub(f.at).Round(time.Second))
		}
		t.Log(line)
	}
	var heavyDone []string
	for _, ch := range heavy {
		heavyDone = append(heavyDone, fmt.Sprintf("%s %d×", ch.name, ch.done))
	}
	t.Logf("soak: %s (grace %s, remediation restart): %d scales, %d rollouts of web, %d of CoreDNS, %d web pods killed, %d Services made and deleted, %d aggregator pods killed, %s; %d faults (found after p50 %s, max %s; restarted by proxyaudit p50 %s; in sync p50 %s; %d recovered by themselves before grace); %d requests answered, %d failed; %d reports, %d with a finding, %d reports not read",
		time.Since(began).Round(time.Second), *soakGrace, scales, rollouts, dnsRollouts, killed, services, aggregatorsKilled, strings.Join(heavyDone, ", "), len(faults), pct(toFind, 50), pct(toFind, 100), pct(toRepair, 50), pct(toHeal, 50), selfHealed,
		ok.Load(), failed.Load(), reports, withFindings, failedReports)
	if len(faults) == 0 {
		t.Errorf("no fault was injected in %s", *soakFor)
	}
	res, grew := processSummary(procs)
	t.Logf("resources, sampled every ~10 s in the pods' processes:\n  %s", strings.Join(res, "\n  "))
	for _, g := range grew {
		t.Errorf("resident set grew past the bound (a quarter of its first minute's and 16 MiB): %s", g)
	}
	// What proxyaudit wrote, as the API server recorded it: leader
	// election, the barrier's stamps, its record, Events, repairs.
	if writes, refused, err := c.AuditedWrites(began); err != nil {
		t.Errorf("proxyaudit's API writes: %v", err)
	} else {
		total := 0
		for _, n := range writes {
			total += n
		}
		t.Logf("API writes by proxyaudit's service accounts (the API server's audit log): %d in %s (%.1f a minute): %s; refused: %s",
			total, time.Since(began).Round(time.Second), float64(total)/time.Since(began).Minutes(), byCount(writes), byCount(refused))
	}
	var keys []string
	for k := range findings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		s := findings[k]
		t.Errorf("false finding in %d reports from +%s: %s %s %s %s: %s", s.count, s.first.Sub(began).Round(time.Second),
			s.f.Kind, s.f.Node, s.f.Service, s.f.Endpoint, s.f.Detail)
	}
	for _, r := range falseRepairs {
		by := "no proxyaudit Event on the node: not proxyaudit's doing"
		mu.Lock()
		if a := actedOn[r.node]; a != "" {
			by = "proxyaudit's " + a
		}
		mu.Unlock()
		t.Errorf("a healthy node's kube-proxy restarted: %s; %s", r.what, by)
	}
	for _, p := range falsePages {
		t.Errorf("a page not for a fault: %s", p)
	}
	if reports < int(*soakFor/(4*time.Second)) {
		t.Errorf("only %d reports read in %s: the soak watched too little to prove silence", reports, *soakFor)
	}
	var udpAnswers, udpRefused []int64
	for _, r := range udp {
		r.stop()
		udpAnswers, udpRefused = append(udpAnswers, r.answers.Load()), append(udpRefused, r.refused.Load())
	}
	t.Logf("traffic: HTTP by name (a connection each) %d answered, %d failed; keep-alive HTTP %d answered, %d failed over %d connections; UDP from one socket a node, answers %v (refused %v); NodePort from outside the nodes %d answered, %d failed",
		ok.Load(), failed.Load(), keptOK.Load(), keptFailed.Load(), keptConns.Load(), udpAnswers, udpRefused, nodePortOK.Load(), nodePortFailed.Load())
	for _, c := range []struct {
		what       string
		ok, failed int64
	}{{"HTTP by name", ok.Load(), failed.Load()}, {"keep-alive HTTP", keptOK.Load(), keptFailed.Load()}, {"NodePort", nodePortOK.Load(), nodePortFailed.Load()}} {
		if c.ok == 0 || c.failed > c.ok/10 {
			t.Errorf("the clients, %s: %d answered, %d failed: the workload is not what a healthy cluster serves", c.what, c.ok, c.failed)
		}
	}
	for i, n := range udpAnswers {
		if n == 0 {
			t.Errorf("the UDP client on %s had no answer", fleet[i].Name)
		}
	}
	waitInSync(ctx, t, c, 3*time.Minute, time.Now(), "after the soak")
}

// soakFault is a fault the soak injected and what became of it.
type soakFault struct {
	kind, node string
	at         time.Time
	undo       localcluster.Undo
	found      time.Time          // the first report with a finding on its node
	first      audit.TimedFinding // that finding
	paged      time.Time          // a page for its node
	byHand     time.Time          // healed as the page says
	repaired   time.Time          // its kube-proxy pod replaced
	drifted    time.Time          // the first report showing the node out of sync
	healed     time.Time          // in sync again after it
	selfHealed bool               // healed by itself before any drift (a hung watch reconnected)
}

// pct is the p-th percentile of ds (0 when empty).
func pct(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(ds))
	return s[min(len(s)-1, (len(s)-1)*p/100)].Round(time.Second)
}

// podProcess is a process of a pod on a real node, sampled by the soak:
// its program, its node and what the kernel counted of it.
type podProcess struct {
	prog, node        string
	first, warm, last localcluster.ProcStat
	firstAt, lastAt   time.Time
	// warmAt is the first sample a minute or more after the first, or
	// after ledAt, when an aggregator began to lead.
	warmAt, ledAt time.Time
	peakRSS       int64
}

// sampleProcesses reads every collector, aggregator and kube-proxy
// process running in a pod on a real node (its cgroup under kubepods)
// into seen, by pid.
func sampleProcesses(seen map[int]*podProcess, leaderUID string) {
	entries, _ := os.ReadDir("/proc")
	now := time.Now()
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil {
			continue
		}
		argv0, _, _ := strings.Cut(string(cmdline), "\x00")
		prog := filepath.Base(argv0)
		if prog != "proxyaudit-collector" && prog != "proxyaudit-aggregator" && prog != "kube-proxy" {
			continue
		}
		cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
		_, rest, ok := strings.Cut(string(cg), ":/pa-")
		node, _, inPod := strings.Cut(rest, "/kubepods/")
		if err != nil || !ok || !inPod {
			continue
		}
		st, err := localcluster.ReadProcStat(pid)
		if err != nil {
			continue
		}
		p := seen[pid]
		if p == nil {
			p = &podProcess{prog: prog, node: node, first: st, firstAt: now}
			seen[pid] = p
		}
		p.last, p.lastAt, p.peakRSS = st, now, max(p.peakRSS, st.RSS)
		if leads := leaderUID != "" && (strings.Contains(string(cg), leaderUID) || strings.Contains(string(cg), strings.ReplaceAll(leaderUID, "-", "_"))); leads && p.ledAt.IsZero() {
			p.ledAt = now
			if now.Sub(p.firstAt) >= 30*time.Second {
				p.warmAt = time.Time{} // a follower that took over: measured anew
			}
		}
		since := p.firstAt
		if p.ledAt.After(since) {
			since = p.ledAt
		}
		if p.warmAt.IsZero() && now.Sub(since) >= time.Minute {
			p.warm, p.warmAt = st, now
		}
	}
}

// processSummary says, per program, the CPU its processes used (a share
// of one core, median and max over processes, children included: the
// collector's iptables-save, kube-proxy's iptables-restore), their
// largest resident set and its growth after the first minute; and
// returns the processes that lived ten minutes or more and grew beyond
// a quarter of their first minute's RSS and 16 MiB more.
func processSummary(seen map[int]*podProcess) (lines, grew []string) {
	byProg := map[string][]*podProcess{}
	for _, p := range seen {
		byProg[p.prog] = append(byProg[p.prog], p)
	}
	for _, prog := range slices.Sorted(maps.Keys(byProg)) {
		var cpu []float64
		var peak, growth int64
		for _, p := range byProg[prog] {
			if d := p.lastAt.Sub(p.firstAt); d > 0 {
				used := p.last.CPU + p.last.ChildCPU - p.first.CPU - p.first.ChildCPU
				cpu = append(cpu, 100*used.Seconds()/d.Seconds())
			}
			peak = max(peak, p.peakRSS)
			if !p.warmAt.IsZero() {
				g := p.last.RSS - p.warm.RSS
				growth = max(growth, g)
				if p.lastAt.Sub(p.warmAt) >= 10*time.Minute && g > p.warm.RSS/4+16<<20 {
					grew = append(grew, fmt.Sprintf("%s on %s: %d MiB a minute after it began%s, %d MiB at the end", prog, p.node, p.warm.RSS>>20, map[bool]string{true: " to lead", false: ""}[!p.ledAt.IsZero()], p.last.RSS>>20))
				}
			}
		}
		slices.Sort(cpu)
		med, top := 0.0, 0.0
		if len(cpu) > 0 {
			med, top = cpu[len(cpu)/2], cpu[len(cpu)-1]
		}
		lines = append(lines, fmt.Sprintf("%s: %d process(es), CPU median %.2f %% of a core (max %.2f %%), peak RSS %d MiB, growth after the first minute at most %d MiB",
			prog, len(byProg[prog]), med, top, peak>>20, growth>>20))
	}
	return lines, grew
}

// byCount lists counts, the largest first: "a 12, b 3".
func byCount(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return m[keys[i]] > m[keys[j]] || m[keys[i]] == m[keys[j]] && keys[i] < keys[j] })
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", k, m[k])
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}
