package stream

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/ipvs"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

func observed(t *testing.T, spec synth.Spec) *audit.Observed {
	t.Helper()
	o, err := spec.Observed()
	if err != nil {
		t.Fatal(err)
	}
	return o
}

func TestFramingRoundTripAndLimits(t *testing.T) {
	var buf bytes.Buffer
	in := &Message{Type: TypeHello, Hello: &Hello{Node: "n1", Token: "t", Version: "v", IntervalSeconds: 10}}
	if err := Write(&buf, in); err != nil {
		t.Fatal(err)
	}
	out, _, err := Read(&buf, DefaultMaxMessageBytes)
	if err != nil || !reflect.DeepEqual(in, out) {
		t.Fatalf("round trip: %+v, %v", out, err)
	}

	// A header announcing 100 MB: refused before a byte of the body is read.
	var hdr [4]byte
	binary.BigEndian.PutUint32(hdr[:], 100<<20)
	r := &countingReader{r: bytes.NewReader(append(hdr[:], make([]byte, 1024)...))}
	if _, _, err := Read(r, DefaultMaxMessageBytes); !errors.Is(err, ErrTooLarge) || r.n != 4 {
		t.Fatalf("oversized: %v after reading %d bytes", err, r.n)
	}

	for name, body := range map[string][]byte{"garbage": []byte("\x00\xffnot json"), "truncated": []byte(`{"type":"he`)} {
		var b bytes.Buffer
		binary.Write(&b, binary.BigEndian, uint32(len(body)+10)) // claims more than it sends
		b.Write(body)
		if _, _, err := Read(&b, DefaultMaxMessageBytes); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

type countingReader struct {
	r interface{ Read([]byte) (int, error) }
	n int
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += n
	return n, err
}

// The collector's deltas keep the aggregator's copy identical: steady state
// sends only the root, a change sends only what changed, and a copy that
// missed a report is caught by the root and resynced.
func TestDeltasKeepBothEndsInSync(t *testing.T) {
	spec := synth.Spec{Services: 50, EndpointsPerService: 4}
	sent, agg := NewState(), NewState()
	next := FromModel(observed(t, spec))
	r := Delta(sent, next, 1, true, false)
	if ok, err := agg.Apply(r); !ok || err != nil || len(r.Frontends) != 50 {
		t.Fatalf("full: ok=%v err=%v frontends=%d", ok, err, len(r.Frontends))
	}
	if !reflect.DeepEqual(agg.Observed(), FromModel(observed(t, spec)).Observed()) {
		t.Fatal("aggregator copy differs from the collector's model")
	}

	steady := Delta(sent, FromModel(observed(t, spec)), 2, false, false)
	if len(steady.Frontends)+len(steady.Removed) != 0 {
		t.Fatalf("steady state sent %d frontends", len(steady.Frontends))
	}
	if ok, _ := agg.Apply(steady); !ok {
		t.Fatal("steady root mismatch")
	}

	// One service loses an endpoint and one disappears.
	smaller := FromModel(observed(t, synth.Spec{Services: 49, EndpointsPerService: 4}))
	var f Frontend
	for _, b := range smaller.buckets {
		if b != nil {
			f = b.entries[0].Frontend
			break
		}
	}
	f.Endpoints = f.Endpoints[1:]
	smaller.replace(nil, []Frontend{f}, nil)
	d := Delta(sent, smaller, 3, false, false)
	if len(d.Frontends) != 1 || len(d.Removed) != 1 {
		t.Fatalf("delta: %d changed, %d removed", len(d.Frontends), len(d.Removed))
	}
	cp := *agg
	lagging := &cp
	if ok, _ := agg.Apply(d); !ok {
		t.Fatal("delta root mismatch")
	}

	// A copy that missed report 3 cannot apply report 4 cleanly.
	again := Delta(sent, FromModel(observed(t, synth.Spec{Services: 48, EndpointsPerService: 4})), 4, false, false)
	if ok, _ := lagging.Apply(again); ok {
		t.Fatal("a copy that missed a delta matched the root")
	}
}

func TestApplyRejectsHostileReports(t *testing.T) {
	huge := &Report{Frontends: make([]Frontend, MaxFrontends+1)}
	bad := map[string]*Report{
		"1M services":  huge,
		"bad key":      {Frontends: []Frontend{{Key: "nonsense", Scope: "cluster"}}},
		"bad endpoint": {Frontends: []Frontend{{Key: "198.19.0.1:80/TCP", Scope: "cluster", Endpoints: []string{"x"}}}},
		"bad scope":    {Frontends: []Frontend{{Key: "198.19.0.1:80/TCP", Scope: "everywhere"}}},
		"bad weights":  {Frontends: []Frontend{{Key: "198.19.0.1:80/TCP", Scope: "cluster", Endpoints: []string{"1.2.3.4:80"}, Weights: []int{1, 2}}}},
		"bad removed":  {Removed: []string{"198.19.0.1/TCP"}},
	}
	for name, r := range bad {
		s := NewState()
		s.replace(nil, []Frontend{{Key: "keep"}}, nil)
		if _, err := s.Apply(r); err == nil {
			t.Errorf("%s: accepted", name)
		} else if s.Len() != 1 {
			t.Errorf("%s: state changed on a rejected report", name)
		}
	}
}

func TestKeyRoundTrip(t *testing.T) {
	for s, fam := range map[string]int{"198.19.0.10:53/UDP": 4, "nodeport:30080/TCP": 4, "[2001:2::1]:443/SCTP": 6, "nodeport6:30080/UDP": 6} {
		k, err := ParseKey(s)
		if err != nil || KeyString(k) != s || k.Family() != fam {
			t.Errorf("%s: %v family %d, %v", s, KeyString(k), k.Family(), err)
		}
	}
	// A dual-stack service's two node ports are two frontends.
	if a, b := audit.NodePortKey(4, "TCP", 30080), audit.NodePortKey(6, "TCP", 30080); a == b || KeyString(a) == KeyString(b) {
		t.Errorf("IPv4 and IPv6 node ports share a key: %v %v", a, b)
	}
	if _, err := ParseKey(strings.Repeat("x", 500)); err == nil || len(err.Error()) > 200 {
		t.Errorf("long garbage key: %v", err)
	}
}

// An IPVS table crosses the stream whole: frontends without a scope (IPVS
// has none), weights including 0 (draining real servers).
func TestIPVSRoundTrip(t *testing.T) {
	obs, err := ipvs.Parse(strings.NewReader("-A -t 198.19.0.10:80 -s rr\n-a -t 198.19.0.10:80 -r 198.18.128.1:8080 -m -w 1\n" +
		"-a -t 198.19.0.10:80 -r 198.18.128.2:8080 -m -w 0\n-A -u 198.19.0.10:53 -s rr -p 600\n"))
	if err != nil {
		t.Fatal(err)
	}
	recv := NewState()
	if _, err := recv.Apply(Delta(NewState(), FromModel(obs), 1, true, false)); err != nil {
		t.Fatal(err)
	}
	got := recv.Observed()
	zero := 0
	for _, f := range got.Frontends {
		for _, e := range f.Endpoints {
			if e.Weight == 0 {
				zero++
			}
		}
	}
	if FromModel(got).Root() != FromModel(obs).Root() || len(got.Frontends) != 2 || zero != 1 || got.Mode != audit.ModeIPVS {
		t.Fatalf("sent %+v\nreceived %+v", obs.Frontends, got.Frontends)
	}
}

// A small message claiming a million services (empty objects, 3 bytes
// each) is refused before it is decoded: decoding it would allocate ~40
// times its size.
func TestReadRefusesAMillionServicesInASmallMessage(t *testing.T) {
	body := []byte(`{"type":"report","report":{"seq":1,"full":true,"frontends":[{}` + strings.Repeat(",{}", 1_000_000-1) + `]}}`)
	frame := binary.BigEndian.AppendUint32(nil, uint32(len(body)))
	frame = append(frame, body...)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, _, err := Read(bytes.NewReader(frame), DefaultMaxMessageBytes)
	runtime.ReadMemStats(&after)
	if err == nil || !strings.Contains(err.Error(), "1000002 JSON objects") {
		t.Fatalf("%d-byte message of a million frontends: %v", len(body), err)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 2*uint64(len(frame)) && !raceEnabled {
		t.Errorf("refusing it allocated %d bytes for a %d-byte message", alloc, len(frame))
	}
	// At the limit it still decodes (and Apply, not Read, judges the count).
	ok := []byte(`{"type":"report","report":{"seq":1,"full":true,"frontends":[{"k":"198.19.0.1:80/TCP","s":"cluster"}]}}`)
	if _, _, err := Read(bytes.NewReader(append(binary.BigEndian.AppendUint32(nil, uint32(len(ok))), ok...)), DefaultMaxMessageBytes); err != nil {
		t.Fatal(err)
	}
}

// TestPoolSharesEqualRulesOnly: nodes reporting the same rules hold the
// same buckets; a node whose report differs in anything (even what the
// digest ignores) keeps its own, and a forged digest collision cannot put
// one node's rules into another's copy.
func TestPoolSharesEqualRulesOnly(t *testing.T) {
	pool := NewPool()
	spec := synth.Spec{Services: 300, EndpointsPerService: 3}
	full := Delta(NewState(), FromModel(observed(t, spec)), 1, true, false)
	a, b := NewPooledState(pool), NewPooledState(pool)
	for _, s := range []*State{a, b} {
		if ok, err := s.Apply(full); !ok || err != nil {
			t.Fatalf("apply: %v %v", ok, err)
		}
	}
	if !a.Same(b) {
		t.Fatal("two nodes with the same rules do not share their buckets")
	}
	f, _ := a.Get(full.Frontends[0].Key)
	renamed := f
	renamed.Chain = "KUBE-SVC-OTHER" // not in the digest
	if ok, err := b.Apply(&Report{Seq: 2, Mode: full.Mode, Families: full.Families, Frontends: []Frontend{renamed}, Root: full.Root}); !ok || err != nil {
		t.Fatalf("apply rename: %v %v", ok, err)
	}
	if a.Same(b) {
		t.Fatal("a node with another chain name shares the first node's buckets")
	}
	if got, _ := a.Get(f.Key); got.Chain != f.Chain {
		t.Fatalf("node a's copy changed to chain %q by node b's report", got.Chain)
	}
	if got, _ := b.Get(f.Key); got.Chain != "KUBE-SVC-OTHER" {
		t.Fatalf("node b's copy shows chain %q", got.Chain)
	}
	// Back to equal: shared again, the way a fleet converges after churn.
	if ok, err := b.Apply(&Report{Seq: 3, Mode: full.Mode, Families: full.Families, Frontends: []Frontend{f}, Root: full.Root}); !ok || err != nil {
		t.Fatalf("apply back: %v %v", ok, err)
	}
	if !a.Same(b) {
		t.Fatal("equal rules not shared after converging")
	}
	// A forged entry under another frontend's digest is kept apart.
	forged := &entry{Frontend: Frontend{Key: f.Key, Scope: f.Scope, Endpoints: []string{"198.18.99.99:80"}}, digest: f.Digest()}
	if got := pool.entry(forged); got != forged {
		t.Fatal("an entry with a colliding digest and other content was replaced by the pooled one")
	}
	if got, _ := a.Get(f.Key); !slices.Equal(got.Endpoints, f.Endpoints) {
		t.Fatal("a colliding entry changed a pooled node's endpoints")
	}
}

// TestPoolForgetsWhatNobodyHolds: the pool does not keep rules alive.
func TestPoolForgetsWhatNobodyHolds(t *testing.T) {
	pool := NewPool()
	s := NewPooledState(pool)
	if _, err := s.Apply(Delta(NewState(), FromModel(observed(t, synth.Spec{Services: 100, EndpointsPerService: 2})), 1, true, false)); err != nil {
		t.Fatal(err)
	}
	if f, b := pool.Size(); f != 100 || b == 0 {
		t.Fatalf("pool holds %d frontends, %d buckets", f, b)
	}
	runtime.KeepAlive(s)
	s = nil
	for range 20 {
		runtime.GC()
		if f, b := pool.Size(); f == 0 && b == 0 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	f, b := pool.Size()
	t.Fatalf("pool still holds %d frontends, %d buckets nobody uses", f, b)
}

// The collector's bulk build and the aggregator's pooled one hold the same
// rules, duplicates resolved the same way (the later frontend wins).
func TestFillMatchesReplace(t *testing.T) {
	o := observed(t, synth.Spec{Services: 300, EndpointsPerService: 3})
	full := Delta(NewState(), FromModel(o), 1, true, false)
	dup := full.Frontends[7]
	dup.Endpoints = []string{"198.18.99.1:80"}
	full.Frontends = append(full.Frontends, dup)
	bulk, pooled := NewState(), NewPooledState(NewPool())
	for _, s := range []*State{bulk, pooled} {
		if _, err := s.Apply(full); err != nil {
			t.Fatal(err)
		}
	}
	if bulk.Root() != pooled.Root() || bulk.Len() != pooled.Len() || bulk.Len() != len(full.Frontends)-1 {
		t.Fatalf("bulk %d frontends root %x, pooled %d root %x", bulk.Len(), bulk.Root(), pooled.Len(), pooled.Root())
	}
	if got, _ := bulk.Get(dup.Key); !reflect.DeepEqual(got.Endpoints, dup.Endpoints) {
		t.Fatalf("duplicate key kept %v, want the later %v", got.Endpoints, dup.Endpoints)
	}
	// A bulk-built state takes deltas like any other.
	cp := *bulk
	d := Delta(&cp, FromModel(observed(t, synth.Spec{Services: 299, EndpointsPerService: 3})), 2, false, false)
	if ok, err := bulk.Apply(d); !ok || err != nil {
		t.Fatalf("delta on a bulk-built state: %v %v", ok, err)
	}
}

// TestRefsResolveOnlyToWhatAnotherNodeSent: a report may name frontends by
// hash; they resolve to content some node of the pool sent, under the
// same key, and nothing else. What the pool does not hold is named in a
// MissingError and leaves the state as it was.
func TestRefsResolveOnlyToWhatAnotherNodeSent(t *testing.T) {
	pool := NewPool()
	rules := FromModel(observed(t, synth.Spec{Services: 50, EndpointsPerService: 3}))
	content := Delta(NewState(), rules, 1, true, false)
	cp := *rules
	named := Delta(NewState(), &cp, 1, true, true)
	if len(named.Frontends) != 0 || len(named.Refs) != len(content.Frontends) {
		t.Fatalf("a full snapshot by refs carries %d frontends and %d refs", len(named.Frontends), len(named.Refs))
	}

	// Nobody sent the content yet: every hash is missing, nothing changes.
	b := NewPooledState(pool)
	_, err := b.Apply(named)
	var me *MissingError
	if !errors.As(err, &me) || len(me.Sums) != len(named.Refs) || b.Len() != 0 {
		t.Fatalf("refs on an empty pool: %v, state of %d", err, b.Len())
	}
	// Node a sends the content; now b's refs resolve to a's entries.
	a := NewPooledState(pool)
	if ok, err := a.Apply(content); !ok || err != nil {
		t.Fatalf("content: %v %v", ok, err)
	}
	if ok, err := b.Apply(named); !ok || err != nil {
		t.Fatalf("refs after content: %v %v", ok, err)
	}
	if !a.Same(b) {
		t.Fatal("a node named by refs does not share the buckets of the node that sent the content")
	}
	// Both ends agree on what was sent: the collector finds the content of
	// the hashes it named.
	sums := []string{named.Refs[0].Sum, named.Refs[7].Sum, "00000000000000000000000000000000"}
	found := cp.Find(sums)
	if len(found) != 2 || found[sums[0]].Key != named.Refs[0].Key || found[sums[0]].Sum() != sums[0] {
		t.Fatalf("Find: %+v", found)
	}

	// Hostile refs: another key's hash, a malformed hash, refs on a stream
	// that holds no pool.
	other := named.Refs[1]
	for name, r := range map[string]*Report{
		"another frontend's hash": {Seq: 2, Mode: named.Mode, Refs: []Ref{{Key: named.Refs[0].Key, Sum: other.Sum}}},
		"upper-case hash":         {Seq: 2, Mode: named.Mode, Refs: []Ref{{Key: other.Key, Sum: strings.ToUpper(other.Sum)}}},
		"short hash":              {Seq: 2, Mode: named.Mode, Refs: []Ref{{Key: other.Key, Sum: other.Sum[:8]}}},
		"bad key":                 {Seq: 2, Mode: named.Mode, Refs: []Ref{{Key: "nope", Sum: other.Sum}}},
	} {
		before := *b
		if _, err := b.Apply(r); err == nil || errors.As(err, &me) {
			t.Errorf("%s: applied (%v)", name, err)
		}
		if !before.Same(b) {
			t.Errorf("%s: state changed", name)
		}
	}
	if _, err := NewState().Apply(named); err == nil || errors.As(err, &me) {
		t.Errorf("refs on an unpooled state: %v", err)
	}

	// A collision in the 64-bit change digest does not make a ref resolve:
	// hashes are SHA-256.
	f := content.Frontends[3]
	forged := Frontend{Key: f.Key, Scope: f.Scope, Endpoints: []string{"198.18.99.99:80"}}
	if forged.Sum() == f.Sum() {
		t.Fatal("distinct frontends share a hash")
	}
}

// TestSumCoversEverything: every field of a frontend, and the order of its
// endpoints, changes its hash; field boundaries cannot be shifted.
func TestSumCoversEverything(t *testing.T) {
	base := Frontend{Key: "198.19.0.10:53/UDP", Scope: "Cluster", Chain: "KUBE-SVC-X", Name: "kube-system/dns:dns",
		Endpoints: []string{"198.18.0.2:53", "198.18.0.3:53"}, Weights: []int{1, 1}}
	seen := map[string]string{base.Sum(): "base"}
	for name, f := range map[string]Frontend{
		"key":       {Key: "198.19.0.11:53/UDP", Scope: base.Scope, Chain: base.Chain, Name: base.Name, Endpoints: base.Endpoints, Weights: base.Weights},
		"scope":     {Key: base.Key, Scope: "Local", Chain: base.Chain, Name: base.Name, Endpoints: base.Endpoints, Weights: base.Weights},
		"chain":     {Key: base.Key, Scope: base.Scope, Chain: "KUBE-SVC-Y", Name: base.Name, Endpoints: base.Endpoints, Weights: base.Weights},
		"shifted":   {Key: base.Key, Scope: base.Scope, Chain: "KUBE-SVC-Xk", Name: "ube-system/dns:dns", Endpoints: base.Endpoints, Weights: base.Weights},
		"order":     {Key: base.Key, Scope: base.Scope, Chain: base.Chain, Name: base.Name, Endpoints: []string{"198.18.0.3:53", "198.18.0.2:53"}, Weights: base.Weights},
		"weight":    {Key: base.Key, Scope: base.Scope, Chain: base.Chain, Name: base.Name, Endpoints: base.Endpoints, Weights: []int{1, 0}},
		"no weight": {Key: base.Key, Scope: base.Scope, Chain: base.Chain, Name: base.Name, Endpoints: base.Endpoints},
	} {
		s := f.Sum()
		if prev, ok := seen[s]; ok {
			t.Errorf("%s hashes like %s", name, prev)
		}
		seen[s] = name
	}
}

// TestReadFrameMemoryFollowsBytesReceived: a header claiming the largest
// message followed by four bytes costs a few KiB, not 16 MiB (3,000 such
// connections grew the heap by 194 MB when the body was allocated from the
// header). A whole frame read in pieces is still read whole.
func TestReadFrameMemoryFollowsBytesReceived(t *testing.T) {
	lying := binary.BigEndian.AppendUint32(nil, DefaultMaxMessageBytes)
	lying = append(lying, "{\"ty"...)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range 100 {
		if _, _, err := ReadFrame(bytes.NewReader(lying), DefaultMaxMessageBytes); err == nil || !strings.Contains(err.Error(), "truncated") {
			t.Fatalf("truncated frame: %v", err)
		}
	}
	runtime.ReadMemStats(&after)
	if per := (after.TotalAlloc - before.TotalAlloc) / 100; per > 16<<10 {
		t.Errorf("a frame claiming %d bytes and sending 4 allocated %d bytes", DefaultMaxMessageBytes, per)
	}
	body := bytes.Repeat([]byte("x"), 3<<20)
	frame := append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
	got, _, err := ReadFrame(iotest.OneByteReader(bytes.NewReader(frame[:1<<10])), DefaultMaxMessageBytes)
	if err == nil {
		t.Fatalf("1 KiB of a 3 MiB frame read as whole: %d bytes", len(got))
	}
	got, n, err := ReadFrame(iotest.HalfReader(bytes.NewReader(frame)), DefaultMaxMessageBytes)
	if err != nil || n != len(frame) || !bytes.Equal(got, body) {
		t.Fatalf("3 MiB frame read in pieces: %d bytes, n=%d, %v", len(got), n, err)
	}
}

func TestReportFactsAndNodeText(t *testing.T) {
	for _, r := range []Report{{Mode: "iptables", Families: []int{4}}, {Mode: "ipvs", Families: []int{6, 4}}, {}} {
		if err := r.CheckFacts(); err != nil {
			t.Errorf("%+v: %v", r, err)
		}
	}
	huge := make([]int, 1<<20)
	for _, r := range []Report{{Mode: "\x1b[31mnftables"}, {Families: huge}, {Families: []int{4, 4}}, {Families: []int{5}}} {
		if err := r.CheckFacts(); err == nil {
			t.Errorf("mode %q, %d families accepted", r.Mode, len(r.Families))
		}
	}
	// Chain and rule names come from the node's rules (comments are free
	// text): cleaned and bounded where they enter.
	of, err := Frontend{Key: "198.19.0.1:80/TCP", Scope: "cluster", Chain: "KUBE-SVC-X\x1b]8;;http://evil\x07" + strings.Repeat("é", 100),
		Name: "ns/a:\u202e80", Endpoints: []string{"198.18.0.1:8080"}}.ToObserved()
	if err != nil {
		t.Fatal(err)
	}
	if strings.ContainsAny(of.Chain+of.Name+of.Endpoints[0].Chain, "\x1b\x07\u202e") || len(of.Chain) > maxName+len("…") || of.Endpoints[0].Chain != of.Chain {
		t.Errorf("names kept as sent: %q %q %q", of.Chain, of.Name, of.Endpoints[0].Chain)
	}
	// Longer than the kernel lets kube-proxy write: refused, not kept.
	for _, f := range []Frontend{
		{Key: "198.19.0.1:80/TCP", Scope: "cluster", Chain: strings.Repeat("é", 600)},
		{Key: "198.19.0.1:80/TCP", Scope: "cluster", Name: strings.Repeat("x", maxName+1)},
		{Key: "[fe80::1%" + strings.Repeat("z", 100) + "]:80/TCP", Scope: "cluster"},
		{Key: "198.19.0.1:80/TCP", Scope: "cluster", Endpoints: []string{"[fe80::1%eth0]:80"}},
	} {
		if _, err := f.ToObserved(); err == nil {
			t.Errorf("frontend of %d+%d+%d bytes, endpoints %q taken", len(f.Key), len(f.Chain), len(f.Name), f.Endpoints)
		}
	}
	// What a collector sends is cut to what is taken.
	long := FromObserved(audit.ObservedFrontend{FrontendKey: audit.FrontendKey{IP: netip.MustParseAddr("198.19.0.1"), Protocol: "TCP", Port: 80},
		Scope: audit.ScopeCluster, Chain: strings.Repeat("é", 600)})
	if _, err := long.ToObserved(); err != nil || len(long.Chain) > maxName {
		t.Errorf("a collector's long chain name: %d bytes, %v", len(long.Chain), err)
	}
}

// 24 small reports at the allowed rate, each adding one frontend with a
// 12 MiB chain name, grew the leader's heap by 300 MiB: a node's copy
// kept names whole. Such a report is refused and the copy holds nothing.
func TestNodeCopyHoldsNoHugeName(t *testing.T) {
	s := NewPooledState(NewPool())
	name := strings.Repeat("K", 12<<20)
	for i := range 24 {
		r := &Report{Seq: uint64(i + 1), Frontends: []Frontend{{Key: fmt.Sprintf("198.19.0.%d:80/TCP", i+1), Scope: "cluster", Chain: name}}}
		if _, err := s.Apply(r); err == nil {
			t.Fatalf("report %d with a 12 MiB chain name applied", i)
		}
	}
	if s.Len() != 0 {
		t.Errorf("the copy holds %d frontends", s.Len())
	}
}

// A collector choosing keys that all fall in one bucket made every
// one-frontend change rebuild that bucket (200,000 frontends: 116 ms of the
// leader's loop instead of 0.5 ms). A bucket over maxBucket is refused;
// 200,000 keys as a node has them spread far below it.
func TestSteeredKeysAreRefused(t *testing.T) {
	var steered []Frontend
	for i := 0; len(steered) <= maxBucket; i++ {
		k := fmt.Sprintf("198.%d.%d.%d:%d/TCP", 18+i>>24&1, i>>16&255, i>>8&255, 1+i&255)
		if bucketOf(k) == 7 {
			steered = append(steered, Frontend{Key: k, Scope: "cluster", Endpoints: []string{"198.18.0.1:80"}})
		}
	}
	s := NewPooledState(NewPool())
	if _, err := s.Apply(&Report{Seq: 1, Full: true, Frontends: steered}); err == nil || !strings.Contains(err.Error(), "keys chosen to fall together") {
		t.Fatalf("%d frontends in one bucket: %v", len(steered), err)
	}
	if s.Len() != 0 {
		t.Errorf("the refused report left %d frontends", s.Len())
	}
	var fs []Frontend
	for i := range MaxFrontends {
		fs = append(fs, Frontend{Key: fmt.Sprintf("198.%d.%d.%d:%d/TCP", 19, i>>10&255, i>>2&255, 80+i&3), Scope: "cluster"})
	}
	// Distinct keys: 256 × 256 addresses × 4 ports is more than MaxFrontends.
	s = NewPooledState(NewPool())
	if _, err := s.Apply(&Report{Seq: 1, Full: true, Frontends: fs}); err != nil {
		t.Fatalf("%d ordinary frontends: %v", len(fs), err)
	}
	largest := 0
	for _, b := range s.buckets {
		if b != nil {
			largest = max(largest, len(b.entries))
		}
	}
	t.Logf("%d ordinary frontends: the largest bucket holds %d (mean %d, limit %d)", s.Len(), largest, s.Len()/nBuckets, maxBucket)
	if largest > maxBucket/2 {
		t.Errorf("the largest bucket of ordinary keys holds %d", largest)
	}
}

// A collector's read stats carry at most MaxReadWarnings warnings of
// bounded size: more is refused, not clipped by the aggregator.
func TestReadStatsWarningsBounded(t *testing.T) {
	ok := &ReadStats{Warnings: []string{"a", strings.Repeat("b", maxReaderText)}}
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []*ReadStats{
		{Warnings: make([]string, MaxReadWarnings+1)},
		{Warnings: []string{strings.Repeat("b", maxReaderText+1)}},
	} {
		if err := bad.Validate(); err == nil {
			t.Errorf("accepted %d warnings of up to %d bytes", len(bad.Warnings), len(bad.Warnings[len(bad.Warnings)-1]))
		}
	}
}

// A newer collector may read for reasons this version does not know:
// they are kept (a collector of version N talks to an aggregator of N-1),
// but only a few, short and printable.
func TestReadStatsReasonsBounded(t *testing.T) {
	known := &ReadStats{Reads: map[ReadReason]uint64{ReadFlushed: 1, ReadChange: 3, "a-reason-of-tomorrow": 2}}
	if err := known.Validate(); err != nil {
		t.Fatal(err)
	}
	many := map[ReadReason]uint64{}
	for i := range maxReadReasons + 1 {
		many[ReadReason(fmt.Sprintf("r%d", i))] = 1
	}
	for _, bad := range []map[ReadReason]uint64{many, {"": 1}, {ReadReason(strings.Repeat("r", maxReasonText+1)): 1}, {"with space": 1}, {"bell\a": 1}} {
		if err := (&ReadStats{Reads: bad}).Validate(); err == nil {
			t.Errorf("accepted reasons %q", slices.Collect(maps.Keys(bad)))
		}
	}
}
