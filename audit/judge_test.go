package audit_test

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// fleet drives a judge the way the aggregator does: the cluster changes
// through a history, nodes report rules, the judge concludes.
type fleet struct {
	t     *testing.T
	spec  synth.Spec
	h     *audit.History
	j     *audit.Judge
	state *audit.State
}

func newFleet(t *testing.T, spec synth.Spec, c cluster) *fleet {
	p := audit.DefaultPolicy()
	p.Grace = 30 * time.Second
	f := &fleet{t: t, spec: spec, h: audit.NewHistory(5 * time.Minute), j: audit.NewJudge(p)}
	f.change(c, t0)
	return f
}

func (f *fleet) change(c cluster, at time.Time) {
	f.state = c.state()
	f.h.Update(f.state, at)
}

func (f *fleet) report(node string, at time.Time, obs *audit.Observed) []time.Duration {
	f.j.Heard(node, audit.Heartbeat{At: at, Interval: 10 * time.Second, Mode: obs.Mode})
	return f.j.Observe(node, at, len(f.state.Services), obs.NoRules, audit.Assess(f.state, f.h, node, obs), f.h)
}

func kinds(v audit.Verdict) string {
	var out []string
	for _, f := range v.Findings {
		out = append(out, f.Node+":"+string(f.Kind))
	}
	return strings.Join(out, " ")
}

func state(v audit.Verdict, node string) audit.NodeState {
	for _, n := range v.Nodes {
		if n.Node == node {
			return n.State
		}
	}
	return ""
}

// A node that shows a change late but within grace is never a finding; a
// node that shows it only after grace is stuck from when the change came,
// with the service's own findings beside the one node finding.
func TestJudgeGraceAndStuckProxy(t *testing.T) {
	spec := synth.Spec{Services: 5, EndpointsPerService: 3}
	v0 := synthCluster(spec)
	f := newFleet(t, spec, v0)
	old, fresh := rulesOf(t, spec, nil), rulesOf(t, spec, withoutEndpoint(spec, 2, 2))
	nodes := []string{"a", "b", "c"}
	for _, n := range nodes {
		f.report(n, t0.Add(time.Second), old)
	}
	t1 := t0.Add(5 * time.Second)
	f.change(dropEndpoint(v0, 2), t1)
	// a catches up at once, b after 25 s (within grace), c never.
	f.report("a", t1.Add(5*time.Second), fresh)
	f.report("b", t1.Add(5*time.Second), old)
	f.report("c", t1.Add(5*time.Second), old)
	if v := f.j.Evaluate(t1.Add(6*time.Second), nodes); len(v.Findings) != 0 || state(v, "b") != audit.NodeLagging {
		t.Fatalf("within grace: %s, b %s", kinds(v), state(v, "b"))
	}
	if lags := f.report("b", t1.Add(25*time.Second), fresh); len(lags) != 1 || lags[0] != 25*time.Second {
		t.Fatalf("b's programming lag samples %v", lags)
	}
	f.report("c", t1.Add(25*time.Second), old)
	f.report("a", t1.Add(25*time.Second), fresh)
	if v := f.j.Evaluate(t1.Add(31*time.Second), nodes); len(v.Findings) != 0 {
		t.Fatalf("grace judged by the evaluation clock, not by reports: %s", kinds(v))
	}
	f.report("c", t1.Add(35*time.Second), old)
	v := f.j.Evaluate(t1.Add(36*time.Second), nodes)
	if got := kinds(v); got != "c:StuckProxy c:StaleEndpoint" {
		t.Fatalf("after grace: %s", got)
	}
	for _, fd := range v.Findings {
		if !fd.Since.Equal(t1) {
			t.Errorf("%s since %v, want %v", fd.Kind, fd.Since, t1)
		}
	}
	if !strings.Contains(v.Findings[0].Detail, "synth/svc-00002") {
		t.Errorf("stuck detail does not name the service: %s", v.Findings[1].Detail)
	}
	if st := state(v, "c"); st != audit.NodeStuck {
		t.Errorf("c is %s", st)
	}
	for _, n := range v.Nodes {
		if n.Node == "c" && (!n.Watermark.Equal(t1) || n.Lagging != 1 || n.InSync != 4) {
			t.Errorf("c status %+v", n)
		}
	}
	// c recovers: the findings clear.
	f.report("c", t1.Add(45*time.Second), fresh)
	if v := f.j.Evaluate(t1.Add(46*time.Second), nodes); len(v.Findings) != 0 || state(v, "c") != audit.NodeInSync {
		t.Fatalf("after recovery: %s", kinds(v))
	}
}

// Divergence counts from when it was first seen and must persist; a
// transient one (kube-proxy caught between two slices) never surfaces.
func TestJudgeDivergenceNeedsToPersist(t *testing.T) {
	spec := synth.Spec{Services: 5, EndpointsPerService: 3}
	f := newFleet(t, spec, synthCluster(spec))
	good := rulesOf(t, spec, nil)
	bad := rulesOf(t, spec, func(s string) string {
		return strings.Replace(s, "--to-destination "+spec.EndpointAddr(1, 0).String()+":8080", "--to-destination 198.18.99.99:8080", 1)
	})
	nodes := []string{"a", "b", "c"}
	for i := 0; i < 4; i++ {
		at := t0.Add(time.Duration(10*i) * time.Second)
		f.report("a", at, good)
		f.report("b", at, good)
		obs := bad
		if i == 2 {
			obs = good
		}
		f.report("c", at, obs)
	}
	if v := f.j.Evaluate(t0.Add(31*time.Second), nodes); len(v.Findings) != 0 {
		t.Fatalf("interrupted divergence surfaced: %s", kinds(v))
	}
	f.report("a", t0.Add(61*time.Second), good)
	f.report("b", t0.Add(61*time.Second), good)
	f.report("c", t0.Add(61*time.Second), bad)
	v := f.j.Evaluate(t0.Add(62*time.Second), nodes)
	if got := kinds(v); got != "c:MissingEndpoint c:StaleEndpoint" || state(v, "c") != audit.NodeDivergent {
		t.Fatalf("persistent divergence: %s (%s)", got, state(v, "c"))
	}
	if !v.Findings[0].Since.Equal(t0.Add(30 * time.Second)) {
		t.Errorf("since %v", v.Findings[0].Since)
	}
}

// A silent collector is its own finding and hides what its last report
// said; a node that never reported is pending for three intervals.
func TestJudgeCollectorMissing(t *testing.T) {
	spec := synth.Spec{Services: 2, EndpointsPerService: 1}
	v0 := synthCluster(spec)
	f := newFleet(t, spec, v0)
	f.report("a", t0, rulesOf(t, spec, nil))
	nodes := []string{"a", "b"}
	if v := f.j.Evaluate(t0.Add(time.Second), nodes); len(v.Findings) != 0 || state(v, "b") != audit.NodePending {
		t.Fatalf("start: %s, b %s", kinds(v), state(v, "b"))
	}
	f.change(dropEndpoint(v0, 1), t0.Add(2*time.Second))
	f.report("a", t0.Add(5*time.Second), rulesOf(t, spec, nil)) // a lags …
	v := f.j.Evaluate(t0.Add(2*time.Minute), nodes)             // … then falls silent
	if got := kinds(v); got != "a:CollectorMissing b:CollectorMissing" {
		t.Fatalf("silent: %s", got)
	}
	for _, at := range []time.Duration{121 * time.Second, 160 * time.Second} {
		f.j.Heard("a", audit.Heartbeat{At: t0.Add(at), Interval: 10 * time.Second, Mode: audit.ModeIPTables, ReadError: "iptables-save: exit status 1"})
	}
	v = f.j.Evaluate(t0.Add(161*time.Second), []string{"a"})
	if len(v.Findings) != 1 || v.Findings[0].Kind != audit.CollectorMissing || !strings.Contains(v.Findings[0].Detail, "exit status 1") {
		t.Fatalf("read errors: %+v", v.Findings)
	}
}

func TestJudgeNoRules(t *testing.T) {
	spec := synth.Spec{Services: 2, EndpointsPerService: 1}
	f := newFleet(t, spec, synthCluster(spec))
	empty := &audit.Observed{Mode: audit.ModeIPTables, NoRules: true}
	f.report("a", t0, empty)
	f.report("a", t0.Add(20*time.Second), empty)
	if v := f.j.Evaluate(t0.Add(21*time.Second), []string{"a"}); len(v.Findings) != 0 {
		t.Fatalf("within grace: %s", kinds(v))
	}
	f.report("a", t0.Add(31*time.Second), empty)
	if v := f.j.Evaluate(t0.Add(32*time.Second), []string{"a"}); kinds(v) != "a:NoRules" || state(v, "a") != audit.NodeNoRules {
		t.Fatalf("past grace: %s", kinds(v))
	}
	f.report("a", t0.Add(40*time.Second), rulesOf(t, spec, nil))
	if v := f.j.Evaluate(t0.Add(41*time.Second), []string{"a"}); len(v.Findings) != 0 {
		t.Fatalf("restored: %s", kinds(v))
	}
}

// When most nodes drift at once, one fleet finding replaces theirs.
func TestJudgeMassDivergence(t *testing.T) {
	spec := synth.Spec{Services: 3, EndpointsPerService: 2}
	v0 := synthCluster(spec)
	f := newFleet(t, spec, v0)
	old := rulesOf(t, spec, nil)
	nodes := []string{"a", "b", "c", "d"}
	for _, n := range nodes {
		f.report(n, t0, old)
	}
	f.change(dropEndpoint(v0, 0), t0.Add(time.Second))
	for _, n := range nodes {
		obs := old
		if n == "d" {
			obs = rulesOf(t, spec, withoutEndpoint(spec, 0, 1))
		}
		f.report(n, t0.Add(40*time.Second), obs)
	}
	v := f.j.Evaluate(t0.Add(41*time.Second), nodes)
	if len(v.Findings) != 1 || v.Findings[0].Kind != audit.MassDivergence || !strings.Contains(v.Findings[0].Detail, "3 of 4") {
		t.Fatalf("got %s: %+v", kinds(v), v.Findings)
	}
	// Two of four is not mass: each stuck node is its own finding.
	f.report("c", t0.Add(50*time.Second), rulesOf(t, spec, withoutEndpoint(spec, 0, 1)))
	if v := f.j.Evaluate(t0.Add(51*time.Second), nodes); kinds(v) != "a:StuckProxy a:StaleEndpoint b:StuckProxy b:StaleEndpoint" {
		t.Fatalf("two of four: %s", kinds(v))
	}
}

// Under steady churn a node one version behind has a lag of one step,
// not the time since it was last fully in sync.
func TestJudgeLagPerChange(t *testing.T) {
	spec := synth.Spec{Services: 5, EndpointsPerService: 4}
	v := []cluster{synthCluster(spec)}
	edits := []func(string) string{nil}
	for k := 1; k <= 3; k++ {
		v = append(v, dropEndpoint(v[k-1], 2))
		prev, drop := edits[k-1], withoutEndpoint(spec, 2, 4-k)
		edits = append(edits, func(s string) string {
			if prev != nil {
				s = prev(s)
			}
			return drop(s)
		})
	}
	f := newFleet(t, spec, v[0])
	f.report("a", t0, rulesOf(t, spec, nil))
	var all []time.Duration
	for k := 1; k <= 3; k++ {
		at := t0.Add(time.Duration(10*k) * time.Second)
		f.change(v[k], at)
		// Each report, 5 s after a change, shows the version before it.
		all = append(all, f.report("a", at.Add(5*time.Second), rulesOf(t, spec, edits[k-1]))...)
	}
	all = append(all, f.report("a", t0.Add(36*time.Second), rulesOf(t, spec, edits[3]))...)
	want := []time.Duration{15 * time.Second, 15 * time.Second, 6 * time.Second}
	if len(all) != len(want) {
		t.Fatalf("samples %v, want %v", all, want)
	}
	for i := range want {
		if all[i] != want[i] {
			t.Fatalf("samples %v, want %v", all, want)
		}
	}
}

// A node that left the cluster (or is going away) is judged while it
// reports and forgotten once silent: scale-down is not a missing collector.
func TestJudgeForgetsNodesThatLeft(t *testing.T) {
	spec := synth.Spec{Services: 2, EndpointsPerService: 1}
	f := newFleet(t, spec, synthCluster(spec))
	f.report("a", t0, rulesOf(t, spec, nil))
	f.report("gone", t0, rulesOf(t, spec, nil))
	if v := f.j.Evaluate(t0.Add(time.Second), []string{"a"}); len(v.Nodes) != 2 || state(v, "gone") != audit.NodeInSync {
		t.Fatalf("a reporting node outside the list: %+v", v.Nodes)
	}
	f.report("a", t0.Add(40*time.Second), rulesOf(t, spec, nil))
	v := f.j.Evaluate(t0.Add(41*time.Second), []string{"a"})
	if len(v.Findings) != 0 || len(v.Nodes) != 1 {
		t.Fatalf("silent departed node: %s %+v", kinds(v), v.Nodes)
	}
}

// Explain marks each endpoint of each frontend against the cluster.
func TestExplain(t *testing.T) {
	spec := synth.Spec{Services: 3, EndpointsPerService: 3}
	c := synthCluster(spec)
	obs := rulesOf(t, spec, nil) // the rules of all three endpoints …
	st := dropEndpoint(c, 1).state()
	// … while the cluster dropped one of svc-00001's and has a new service.
	bigger := synthCluster(synth.Spec{Services: 4, EndpointsPerService: 3})
	st.Services = append(st.Services, audit.FromAPI(bigger.svcs[3:], bigger.slices[3:], nil).Services...)
	tr := audit.Explain(audit.ExpectedFor(st, "n1"), obs, "synth/svc-00001")
	if len(tr) != 1 || len(tr[0].Frontends) != 1 {
		t.Fatalf("trace %+v", tr)
	}
	var got []string
	for _, e := range tr[0].Frontends[0].Endpoints {
		got = append(got, e.Status)
		if e.Status != audit.TraceMissing && e.Chain == "" {
			t.Errorf("endpoint %s without its rule chain", e.Endpoint)
		}
	}
	if strings.Join(got, ",") != "ok,ok,stale" || tr[0].Frontends[0].Chain == "" {
		t.Fatalf("svc-00001: %v (%+v)", got, tr[0].Frontends[0])
	}
	all := audit.Explain(audit.ExpectedFor(st, "n1"), obs, "")
	last := all[len(all)-1]
	if last.Service != "synth/svc-00003" || last.Frontends[0].Status != audit.TraceMissing || len(last.Frontends[0].Endpoints) != 3 {
		t.Fatalf("new service: %+v", last)
	}
}

// ipvsOf is the IPVS table a healthy kube-proxy programs for st on node
// (cluster, external and load-balancer IPs; node ports need addresses and
// are left out), plus extra real servers.
func ipvsOf(st *audit.State, node string, extra map[netip.AddrPort]audit.RealServer) *audit.Observed {
	var vs []audit.VirtualServer
	for _, p := range audit.ExpectedFor(st, node).Ports {
		for _, fe := range p.Frontends {
			if fe.NodePort {
				continue
			}
			v := audit.VirtualServer{Addr: netip.AddrPortFrom(fe.IP, fe.Port), Protocol: fe.Protocol, Scheduler: "rr"}
			for _, a := range p.Want(fe.Scope, audit.ModeIPVS) {
				v.Real = append(v.Real, audit.RealServer{Addr: a, Weight: 1})
			}
			if rs, ok := extra[v.Addr]; ok {
				v.Real = append(v.Real, rs)
			}
			vs = append(vs, v)
		}
	}
	return audit.FromIPVS(vs)
}

// An IPVS real server at weight 0 whose endpoint left the service is
// draining: no finding while younger than WeightZeroLimit, whatever the
// grace; a StaleEndpoint saying so once older; nothing once kube-proxy
// removed it. A real server at weight 0 the cluster still lists is
// missing (it gets no new connections).
func TestJudgeIPVSWeightZero(t *testing.T) {
	spec := synth.Spec{Services: 3, EndpointsPerService: 3}
	v0 := synthCluster(spec)
	p := audit.DefaultPolicy()
	p.WeightZeroLimit = 10 * time.Minute
	f := &fleet{t: t, spec: spec, h: audit.NewHistory(5 * time.Minute), j: audit.NewJudge(p)}
	f.change(v0, t0)
	f.report("a", t0.Add(time.Second), ipvsOf(f.state, "a", nil))
	t1 := t0.Add(10 * time.Second)
	f.change(dropEndpoint(v0, 1), t1)
	gone := spec.EndpointAddr(1, 2) // dropEndpoint drops the last
	var vip netip.AddrPort
	for _, p := range audit.ExpectedFor(f.state, "a").Ports {
		if p.Name.Name == synth.ServiceName(1) {
			vip = netip.AddrPortFrom(p.Frontends[0].IP, p.Frontends[0].Port)
		}
	}
	draining := ipvsOf(f.state, "a", map[netip.AddrPort]audit.RealServer{vip: {Addr: netip.AddrPortFrom(gone, 8080), Weight: 0, ActiveConns: 2}})
	for _, at := range []time.Duration{2 * time.Second, time.Minute, 9 * time.Minute} {
		f.report("a", t1.Add(at), draining)
		if v := f.j.Evaluate(t1.Add(at), []string{"a"}); len(v.Findings) != 0 || state(v, "a") != audit.NodeInSync {
			t.Fatalf("draining for %s: %s, state %s", at, kinds(v), state(v, "a"))
		}
	}
	f.report("a", t1.Add(11*time.Minute), draining)
	v := f.j.Evaluate(t1.Add(11*time.Minute), []string{"a"})
	if len(v.Findings) != 1 || v.Findings[0].Kind != audit.StaleEndpoint || v.Findings[0].Endpoint != netip.AddrPortFrom(gone, 8080).String() ||
		!strings.Contains(v.Findings[0].Detail, "weight 0") || !v.Findings[0].Since.Equal(t1.Add(2*time.Second)) {
		t.Fatalf("past the limit: %+v", v.Findings)
	}
	f.report("a", t1.Add(12*time.Minute), ipvsOf(f.state, "a", nil))
	if v := f.j.Evaluate(t1.Add(12*time.Minute), []string{"a"}); len(v.Findings) != 0 {
		t.Fatalf("removed: %s", kinds(v))
	}

	// A listed endpoint at weight 0 is missing after grace.
	listed := ipvsOf(f.state, "a", nil)
	for i := range listed.Frontends {
		for j := range listed.Frontends[i].Endpoints {
			if listed.Frontends[i].Endpoints[j].Addr == netip.AddrPortFrom(spec.EndpointAddr(0, 0), 8080) {
				listed.Frontends[i].Endpoints[j].Weight = 0
			}
		}
	}
	fs := audit.Diff(audit.ExpectedFor(f.state, "a"), listed)
	if len(fs) != 1 || fs[0].Kind != audit.MissingEndpoint || !strings.Contains(fs[0].Detail, "weight 0") {
		t.Fatalf("listed endpoint at weight 0: %+v", fs)
	}

	// WeightZeroLimit 0 never reports one.
	p.WeightZeroLimit = 0
	f.j = audit.NewJudge(p)
	f.report("a", t1.Add(time.Second), draining)
	f.report("a", t1.Add(24*time.Hour), draining)
	if v := f.j.Evaluate(t1.Add(24*time.Hour), []string{"a"}); len(v.Findings) != 0 {
		t.Fatalf("limit 0: %s", kinds(v))
	}
}

func TestKnownBadKubeProxy(t *testing.T) {
	for v, bad := range map[string]bool{
		"v1.11.4": false, "v1.11.5": true, "v1.11.6": true, "v1.11.7": false,
		"v1.12.1": false, "v1.12.2": true, "v1.12.3-gke.1": true, "1.12.4+k3s1": true, "v1.12.5": false,
		"v1.13.0": true, "v1.13.1": true, "v1.13.2": false, "v1.36.3": false, "": false, "garbage": false, "v2.12.3": false,
	} {
		if got := audit.KnownBadKubeProxy(v) != ""; got != bad {
			t.Errorf("%q: bad %v, want %v", v, got, bad)
		}
	}
	// The warning shows on an IPVS node only: the hang is in IPVS's
	// graceful termination.
	j := audit.NewJudge(audit.DefaultPolicy())
	for node, mode := range map[string]audit.Mode{"ipvs": audit.ModeIPVS, "ipt": audit.ModeIPTables} {
		j.Heard(node, audit.Heartbeat{At: t0, Interval: 10 * time.Second, Mode: mode, KubeProxy: &audit.KubeProxySignal{Version: "v1.12.3"}})
	}
	v := j.Evaluate(t0.Add(time.Second), []string{"ipvs", "ipt"})
	audit.WarnKnownBad(&v, nil)
	for _, n := range v.Nodes {
		if (len(n.Warnings) == 1) != (n.Node == "ipvs") {
			t.Errorf("%s: warnings %q", n.Node, n.Warnings)
		}
	}
	// Without a version in the metrics, the Node's status says it.
	j = audit.NewJudge(audit.DefaultPolicy())
	j.Heard("ipvs", audit.Heartbeat{At: t0, Interval: 10 * time.Second, Mode: audit.ModeIPVS, KubeProxy: &audit.KubeProxySignal{}})
	v = j.Evaluate(t0.Add(time.Second), []string{"ipvs"})
	audit.WarnKnownBad(&v, map[string]audit.NodeInfo{"ipvs": {KubeProxyVersion: "v1.13.1"}})
	if len(v.Nodes[0].Warnings) != 1 || !strings.Contains(v.Nodes[0].Warnings[0], "v1.13.1") {
		t.Errorf("from the Node's status: %q", v.Nodes[0].Warnings)
	}
}
