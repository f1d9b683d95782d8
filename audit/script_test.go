package audit_test

import (
	"fmt"
	"hash/fnv"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// TestJudgeScripts runs the judge's behaviour over time from the scripts in
// testdata/judge: a synthetic cluster changes, nodes report rules, the judge
// concludes. A change to grace, stuck, missing, divergence or recovery
// behaviour shows up as a diff of those files; regenerate them with
//
//	go test ./audit -run TestJudgeScripts -rewrite
//
// and review the diff. The commands:
//
//	policy [grace=30s] [missing-intervals=3] [mass-share=0.5] [mass-min=3] [weight-zero-limit=30m]
//	    a judge with no memory (default: DefaultPolicy with grace 30s)
//	cluster services=N endpoints=M [keep=5m]
//	    version v0 of a synthetic cluster (synth.Spec) at +0s; a fresh history
//	change at=D [drop=(I,…)] [delete=(I,…)] [create=(I,…)]
//	    a new version: the last endpoint of each service I is gone, the
//	    service is deleted, or created (as synth makes service I)
//	node name=N [zone=Z] [kube-proxy-version=V]
//	    what the Node object says (for WarnKnownBad)
//	report node=N at=D rules=vK|none [mode=iptables|ipvs] [interval=10s]
//	       [without=(I/J,…)] [tamper=(I/J,…)] [weight0=(I/J,…)] [draining=(I/J,…)]
//	       [foreign=(I,…)]
//	    node N's collector reports the rules a healthy kube-proxy programs
//	    for version K, edited: without drops endpoint J of service I,
//	    tamper replaces it with 198.18.99.99, weight0 sets its IPVS weight
//	    to 0, draining adds it back at weight 0; foreign adds the rules of
//	    synth service I, whatever the cluster holds; prints the programming-lag
//	    samples the report completed
//	heard node=N at=D [mode=…] [interval=10s] [kube-proxy-version=V]
//	    a report without rules; the input, if any, is the read error
//	assess node=N rules=… (edits as for report)
//	    the per-service assessment against the current version
//	diff node=N rules=… (edits as for report)
//	    the findings of one snapshot against the current version
//	versions service=NS/NAME
//	    the versions the history keeps of a service
//	evaluate at=D nodes=(N,…) [known-bad] [details]
//	    the verdict: one line per node, then the findings (details of
//	    node-level findings always, of the others with details)
//
// Times are offsets from t0 and print as +D.
func TestJudgeScripts(t *testing.T) {
	datadriven.Walk(t, "testdata/judge", func(t *testing.T, path string) {
		s := &script{}
		s.setPolicy(audit.DefaultPolicy())
		datadriven.RunTest(t, path, func(t *testing.T, d *datadriven.TestData) string {
			return s.run(t, d)
		})
	})
}

type script struct {
	policy audit.Policy
	j      *audit.Judge
	// shards judge the same nodes split three ways, as replicas sharing
	// the fleet do (issue #41): Conclude over their partials must say
	// what j says at every evaluate.
	shards   [3]*audit.Judge
	h        *audit.History
	spec     synth.Spec
	versions []cluster
	nodes    map[string]audit.NodeInfo
}

func (s *script) setPolicy(p audit.Policy) {
	p.Grace = 30 * time.Second
	s.policy, s.j = p, audit.NewJudge(p)
	for i := range s.shards {
		s.shards[i] = audit.NewJudge(p)
	}
}

// shard is the judge of node among shards.
func (s *script) shard(node string) *audit.Judge {
	h := fnv.New32a()
	h.Write([]byte(node))
	return s.shards[h.Sum32()%uint32(len(s.shards))]
}

func (s *script) current() *audit.State { return s.versions[len(s.versions)-1].state() }

func (s *script) run(t *testing.T, d *datadriven.TestData) string {
	switch d.Cmd {
	case "policy":
		p := audit.DefaultPolicy()
		s.setPolicy(p)
		p = s.policy
		for _, a := range d.CmdArgs {
			v := a.SingleVal(t)
			switch a.Key {
			case "grace":
				p.Grace = duration(t, v)
			case "missing-intervals":
				p.MissingIntervals = integer(t, v)
			case "mass-share":
				f, err := strconv.ParseFloat(v, 64)
				if err != nil {
					t.Fatalf("%s: mass-share %q: %v", d.Pos, v, err)
				}
				p.MassShare = f
			case "mass-min":
				p.MassMinNodes = integer(t, v)
			case "weight-zero-limit":
				p.WeightZeroLimit = duration(t, v)
			default:
				t.Fatalf("%s: policy has no %q", d.Pos, a.Key)
			}
		}
		s.policy, s.j = p, audit.NewJudge(p)
		for i := range s.shards {
			s.shards[i] = audit.NewJudge(p)
		}
		return ""
	case "cluster":
		s.spec = synth.Spec{}
		d.ScanArgs(t, "services", &s.spec.Services)
		d.ScanArgs(t, "endpoints", &s.spec.EndpointsPerService)
		keep := "5m"
		d.MaybeScanArgs(t, "keep", &keep)
		s.h = audit.NewHistory(duration(t, keep))
		s.versions = []cluster{synthCluster(s.spec)}
		s.h.Update(s.current(), t0)
		return "v0"
	case "change":
		next := s.versions[len(s.versions)-1]
		for _, v := range argVals(d, "drop") {
			next = dropEndpoint(next, integer(t, v))
		}
		for _, v := range argVals(d, "delete") {
			name := synth.ServiceName(integer(t, v))
			next = cluster{
				svcs:   slices.DeleteFunc(slices.Clone(next.svcs), func(s corev1.Service) bool { return s.Name == name }),
				slices: slices.DeleteFunc(slices.Clone(next.slices), func(s discoveryv1.EndpointSlice) bool { return s.Labels[discoveryv1.LabelServiceName] == name }),
			}
		}
		for _, v := range argVals(d, "create") {
			i := integer(t, v)
			more := synthCluster(synth.Spec{Services: i + 1, EndpointsPerService: s.spec.EndpointsPerService})
			next = cluster{svcs: append(slices.Clone(next.svcs), more.svcs[i]), slices: append(slices.Clone(next.slices), more.slices[i])}
		}
		s.versions = append(s.versions, next)
		s.h.Update(s.current(), at(t, d))
		return fmt.Sprintf("v%d", len(s.versions)-1)
	case "versions":
		var b strings.Builder
		for _, v := range s.h.Versions(arg(t, d, "service")) {
			state := "absent"
			if v.Svc != nil {
				state = fmt.Sprintf("%d endpoint(s)", len(v.Svc.Slices[0].Endpoints))
			}
			fmt.Fprintf(&b, "since=%s %s\n", rel(v.Since), state)
		}
		return b.String()
	case "node":
		var name string
		d.ScanArgs(t, "name", &name)
		info := s.nodeInfo()[name]
		d.MaybeScanArgs(t, "zone", &info.Zone)
		d.MaybeScanArgs(t, "kube-proxy-version", &info.KubeProxyVersion)
		s.nodes[name] = info
		return ""
	case "heard":
		hb := s.heartbeat(t, d, audit.Mode(optArg(d, "mode", "")), strings.TrimSpace(d.Input))
		s.j.Heard(arg(t, d, "node"), hb)
		s.shard(arg(t, d, "node")).Heard(arg(t, d, "node"), hb)
		return ""
	case "report":
		obs := s.rules(t, d)
		node := arg(t, d, "node")
		hb := s.heartbeat(t, d, obs.Mode, "")
		s.j.Heard(node, hb)
		st := s.current()
		as := audit.Assess(st, s.h, node, obs)
		lags := s.j.Observe(node, hb.At, hb.At, len(st.Services), obs.NoRules, as, s.h)
		s.shard(node).Heard(node, hb)
		s.shard(node).Observe(node, hb.At, hb.At, len(st.Services), obs.NoRules, as, s.h)
		if len(lags) == 0 {
			return ""
		}
		return "lag " + joinDurations(lags)
	case "assess":
		var b strings.Builder
		for _, a := range audit.Assess(s.current(), s.h, arg(t, d, "node"), s.rules(t, d)) {
			fmt.Fprintf(&b, "%s %s", orDash(a.Service), a.State)
			if !a.Since.IsZero() {
				fmt.Fprintf(&b, " since=%s", rel(a.Since))
			}
			b.WriteString("\n")
			for _, f := range a.Findings {
				fmt.Fprintf(&b, "  %s\n", findingLine(f))
				if f.Service == "" {
					fmt.Fprintf(&b, "    %s\n", f.Detail)
				}
			}
			for _, f := range a.Draining {
				fmt.Fprintf(&b, "  draining %s\n", findingLine(f))
			}
		}
		return b.String()
	case "diff":
		node := arg(t, d, "node")
		var b strings.Builder
		for _, f := range audit.Diff(audit.ExpectedFor(s.current(), node), s.rules(t, d)) {
			fmt.Fprintf(&b, "%s\n  %s\n", findingLine(f), f.Detail)
		}
		return b.String()
	case "evaluate":
		v := s.j.Evaluate(at(t, d), argVals(d, "nodes"))
		var parts []audit.Partial
		for _, j := range s.shards {
			var mine []string
			for _, n := range argVals(d, "nodes") {
				if s.shard(n) == j {
					mine = append(mine, n)
				}
			}
			parts = append(parts, j.JudgeNodes(at(t, d), mine))
		}
		split := audit.Conclude(s.policy, parts...)
		if d.HasArg("known-bad") {
			audit.WarnKnownBad(&v, s.nodeInfo())
			audit.WarnKnownBad(&split, s.nodeInfo())
		}
		text := verdictText(v, d.HasArg("details"))
		if got := verdictText(split, d.HasArg("details")); got != text {
			t.Errorf("%s: the nodes judged in three shards and concluded together say\n%s\nwhere one judge of them all says\n%s", d.Pos, got, text)
		}
		return text
	}
	t.Fatalf("%s: unknown command %q", d.Pos, d.Cmd)
	return ""
}

func (s *script) nodeInfo() map[string]audit.NodeInfo {
	if s.nodes == nil {
		s.nodes = map[string]audit.NodeInfo{}
	}
	return s.nodes
}

func (s *script) heartbeat(t *testing.T, d *datadriven.TestData, mode audit.Mode, readErr string) audit.Heartbeat {
	hb := audit.Heartbeat{At: at(t, d), Interval: duration(t, optArg(d, "interval", "10s")), Mode: mode, ReadError: readErr}
	if v := optArg(d, "kube-proxy-version", ""); v != "" {
		hb.KubeProxy = &audit.KubeProxySignal{Version: v}
	}
	return hb
}

// rules builds a report's snapshot: what a healthy kube-proxy programs for
// a version of the cluster on the node, edited.
func (s *script) rules(t *testing.T, d *datadriven.TestData) *audit.Observed {
	mode := audit.Mode(optArg(d, "mode", string(audit.ModeIPTables)))
	which := arg(t, d, "rules")
	if which == "none" {
		return &audit.Observed{Mode: mode, Families: []int{4}, NoRules: true}
	}
	k, err := strconv.Atoi(strings.TrimPrefix(which, "v"))
	if err != nil || !strings.HasPrefix(which, "v") || k < 0 || k >= len(s.versions) {
		t.Fatalf("%s: rules=%q: want none or v0…v%d", d.Pos, which, len(s.versions)-1)
	}
	node := arg(t, d, "node")
	st := s.versions[k].state()
	if vs := argVals(d, "foreign"); len(vs) > 0 {
		n := 0
		for _, v := range vs {
			n = max(n, integer(t, v)+1)
		}
		more := synthCluster(synth.Spec{Services: n, EndpointsPerService: s.spec.EndpointsPerService}).state()
		for _, v := range vs {
			st.Services = append(st.Services, more.Services[integer(t, v)])
		}
	}
	obs := &audit.Observed{Mode: mode, Families: []int{4}}
	for _, p := range audit.ExpectedFor(st, node).Ports {
		for _, fe := range p.Frontends {
			of := audit.ObservedFrontend{FrontendKey: fe.FrontendKey, Scope: fe.Scope, Chain: "svc:" + p.Name.String(), Name: p.Name.String()}
			for _, a := range p.Want(fe.Scope, mode) {
				of.Endpoints = append(of.Endpoints, endpoint(a, mode, 1))
			}
			obs.Frontends = append(obs.Frontends, of)
		}
	}
	edit := func(key string, f func(of *audit.ObservedFrontend, addr netip.AddrPort)) {
		for _, v := range argVals(d, key) {
			is, js, ok := strings.Cut(v, "/")
			if !ok {
				t.Fatalf("%s: %s=%q: want service/endpoint indexes", d.Pos, key, v)
			}
			i, j := integer(t, is), integer(t, js)
			addr := netip.AddrPortFrom(s.spec.EndpointAddr(i, j), 8080)
			for fi := range obs.Frontends {
				if obs.Frontends[fi].Chain == "svc:"+synth.Namespace+"/"+synth.ServiceName(i)+":http" {
					f(&obs.Frontends[fi], addr)
				}
			}
		}
	}
	edit("without", func(of *audit.ObservedFrontend, a netip.AddrPort) {
		of.Endpoints = slices.DeleteFunc(of.Endpoints, func(e audit.Endpoint) bool { return e.Addr == a })
	})
	edit("tamper", func(of *audit.ObservedFrontend, a netip.AddrPort) {
		for i := range of.Endpoints {
			if of.Endpoints[i].Addr == a {
				of.Endpoints[i] = endpoint(netip.AddrPortFrom(netip.MustParseAddr("198.18.99.99"), 8080), mode, 1)
			}
		}
	})
	edit("weight0", func(of *audit.ObservedFrontend, a netip.AddrPort) {
		for i := range of.Endpoints {
			if of.Endpoints[i].Addr == a {
				of.Endpoints[i].Weight = 0
			}
		}
	})
	edit("draining", func(of *audit.ObservedFrontend, a netip.AddrPort) {
		of.Endpoints = append(of.Endpoints, endpoint(a, mode, 0))
	})
	return obs
}

func endpoint(a netip.AddrPort, mode audit.Mode, weight int) audit.Endpoint {
	e := audit.Endpoint{Addr: a, Weight: -1, Chain: "sep:" + a.String()}
	if mode == audit.ModeIPVS {
		e.Weight = weight
	}
	return e
}

func verdictText(v audit.Verdict, details bool) string {
	var b strings.Builder
	for _, n := range v.Nodes {
		fmt.Fprintf(&b, "%s %s", n.Node, n.State)
		if n.Mode != "" {
			fmt.Fprintf(&b, " mode=%s", n.Mode)
		}
		if n.Services > 0 {
			fmt.Fprintf(&b, " services=%d in-sync=%d lagging=%d divergent=%d", n.Services, n.InSync, n.Lagging, n.Divergent)
		}
		if !n.Watermark.IsZero() {
			fmt.Fprintf(&b, " watermark=%s", rel(n.Watermark))
		}
		if n.Lag.Samples > 0 {
			fmt.Fprintf(&b, " lag=(n=%d p50=%gs max=%gs)", n.Lag.Samples, n.Lag.P50, n.Lag.Max)
		}
		if n.ReadError != "" {
			fmt.Fprintf(&b, " read-error=%q", n.ReadError)
		}
		b.WriteString("\n")
		for _, w := range n.Warnings {
			fmt.Fprintf(&b, "  warning: %s\n", w)
		}
	}
	if len(v.Findings) == 0 {
		b.WriteString("no findings\n")
	}
	for _, f := range v.Findings {
		fmt.Fprintf(&b, "%s since=%s\n", findingLine(f.Finding), rel(f.Since))
		if details || f.Service == "" {
			fmt.Fprintf(&b, "  %s\n", f.Detail)
		}
	}
	return b.String()
}

func findingLine(f audit.Finding) string {
	parts := []string{orDash(f.Node), string(f.Kind)}
	if f.Service != "" || f.Endpoint != "" {
		parts = append(parts, orDash(f.Service), orDash(f.Port), orDash(f.Endpoint))
	}
	return strings.Join(parts, " ")
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func rel(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return "+" + t.Sub(t0).String()
}

func joinDurations(ds []time.Duration) string {
	ds = slices.Clone(ds)
	slices.Sort(ds)
	s := make([]string, len(ds))
	for i, d := range ds {
		s[i] = d.String()
	}
	return strings.Join(s, " ")
}

func at(t *testing.T, d *datadriven.TestData) time.Time {
	return t0.Add(duration(t, arg(t, d, "at")))
}

func arg(t *testing.T, d *datadriven.TestData, key string) string {
	var v string
	d.ScanArgs(t, key, &v)
	return v
}

func optArg(d *datadriven.TestData, key, def string) string {
	if a, ok := d.Arg(key); ok && len(a.Vals) == 1 {
		return a.Vals[0]
	}
	return def
}

func argVals(d *datadriven.TestData, key string) []string {
	if a, ok := d.Arg(key); ok {
		return a.Vals
	}
	return nil
}

func duration(t *testing.T, s string) time.Duration {
	d, err := time.ParseDuration(s)
	if err != nil {
		t.Fatalf("duration %q: %v", s, err)
	}
	return d
}

func integer(t *testing.T, s string) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatalf("integer %q: %v", s, err)
	}
	return n
}
