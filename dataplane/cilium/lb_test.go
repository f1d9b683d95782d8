package cilium

import (
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"flag"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/testkit/readertest"
)

var update = flag.Bool("update", false, "rewrite golden findings under testdata/")

func readCiliumCapture(t testing.TB, dir string) []MapDump {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "maps.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d []MapDump
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	return d
}

// The genuine agent's maps (captured by deploy/cilium/capture.sh from
// cilium-agent with kube-proxy replacement) decode to exactly what the
// agent's own tool read from them at the same moment: every entry of
// `cilium-dbg bpf lb list`, flags included, and every backend of
// `cilium-dbg service list` with its state.
func TestCiliumCapturesReadAsCiliumDbgReadsThem(t *testing.T) {
	dirs, _ := filepath.Glob("testdata/*")
	if len(dirs) == 0 {
		t.Fatal("no captures in testdata/cilium (deploy/cilium/capture.sh makes them)")
	}
	space := regexp.MustCompile(`\s+`)
	backend := regexp.MustCompile(`(\d+) => (\S+)/(TCP|UDP|SCTP) \((\w+)\)`)
	for _, dir := range dirs {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			lb, err := Decode(readCiliumCapture(t, dir))
			if err != nil {
				t.Fatal(err)
			}
			raw, err := os.ReadFile(filepath.Join(dir, "lb-list.txt"))
			if err != nil {
				t.Fatal(err)
			}
			var want []string
			for _, l := range strings.Split(strings.TrimSpace(string(raw)), "\n")[1:] {
				want = append(want, strings.TrimSpace(space.ReplaceAllString(l, " ")))
			}
			slices.Sort(want)
			if got := lb.Lines(); !slices.Equal(got, want) {
				t.Errorf("decoded:\n%s\ncilium-dbg bpf lb list:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
			}
			svc, err := os.ReadFile(filepath.Join(dir, "service-list.txt"))
			if os.IsNotExist(err) && filepath.Base(dir) == "frozen" {
				return // the frozen agent answers no API
			}
			if err != nil {
				t.Fatal(err)
			}
			seen := 0
			for _, m := range backend.FindAllStringSubmatch(string(svc), -1) {
				addr, proto, state := m[2], m[3], m[4]
				found := false
				for _, be := range lb.Backends {
					found = found || (be.Addr.String() == addr && be.Protocol == proto && be.State.String() == state)
				}
				if !found {
					t.Errorf("cilium-dbg lists backend %s/%s %s; not among the decoded backends %v", addr, proto, state, lb.Backends)
				}
				seen++
			}
			fams := []int{4}
			if filepath.Base(dir) == "dualstack" {
				fams = []int{4, 6}
			}
			if seen == 0 || !slices.Equal(lb.Families, fams) {
				t.Errorf("%d backends in the service list, families %v, want %v", seen, lb.Families, fams)
			}
		})
	}
}

// A map of another layout, or entries that are not of its sizes, is an
// error naming the map: never a guess.
func TestCiliumLayoutsAreKnownNotGuessed(t *testing.T) {
	good := readCiliumCapture(t, "testdata/scenario")
	for name, mutate := range map[string]func(d []MapDump){
		"a services value of 16 bytes": func(d []MapDump) { d[0].ValueSize = 16 },
		"a key that is not hex":        func(d []MapDump) { d[0].Entries[0].Key = "zz" + d[0].Entries[0].Key[2:] },
		"a value one byte short":       func(d []MapDump) { d[0].Entries[0].Value = d[0].Entries[0].Value[2:] },
	} {
		d := make([]MapDump, len(good))
		for i := range good {
			d[i] = good[i]
			d[i].Entries = slices.Clone(good[i].Entries)
		}
		if d[0].Name != Services4 {
			t.Fatalf("the capture's first map is %s", d[0].Name)
		}
		mutate(d)
		if _, err := Decode(d); err == nil || !strings.Contains(err.Error(), Services4) {
			t.Errorf("%s: %v, want an error naming %s", name, err, Services4)
		}
	}
	// A map proxyaudit does not read (another of Cilium's) is ignored.
	if _, err := Decode(append(slices.Clone(good), MapDump{Name: "cilium_lb4_maglev", KeySize: 2, ValueSize: 4})); err != nil {
		t.Error(err)
	}
}

// Any bytes of the known sizes decode without panicking, into frontends
// whose slots never exceed what was read.
func FuzzDecode(f *testing.F) {
	for _, d := range readCiliumCapture(f, "testdata/scenario") {
		for _, e := range d.Entries[:min(3, len(d.Entries))] {
			k, _ := hex.DecodeString(e.Key)
			v, _ := hex.DecodeString(e.Value)
			f.Add(d.Name, k, v)
		}
	}
	f.Fuzz(func(t *testing.T, name string, k, v []byte) {
		sizes, ok := layouts[name]
		if !ok {
			return
		}
		k = append(k, make([]byte, max(0, sizes[0]-len(k)))...)[:sizes[0]]
		v = append(v, make([]byte, max(0, sizes[1]-len(v)))...)[:sizes[1]]
		lb, err := Decode([]MapDump{{Name: name, KeySize: sizes[0], ValueSize: sizes[1], Entries: []Entry{{Key: hex.EncodeToString(k), Value: hex.EncodeToString(v)}}}})
		if err != nil {
			t.Fatal(err)
		}
		for _, fr := range lb.Frontends {
			if len(fr.Slots) > 1 {
				t.Fatalf("%d slots from one entry", len(fr.Slots))
			}
		}
		_ = lb.Lines()
		// The entry among the genuine agent's: it may name their backends
		// and take over their slots or masters. Reduced and judged, every
		// endpoint must be a decoded backend, and nothing may panic.
		all := readCiliumCapture(t, "testdata/scenario")
		for i := range all {
			if all[i].Name == name {
				all[i].Entries = append(all[i].Entries, Entry{Key: hex.EncodeToString(k), Value: hex.EncodeToString(v)})
			}
		}
		lb, err = Decode(all)
		if err != nil {
			t.Fatal(err)
		}
		obs := lb.Observed()
		backends := map[netip.AddrPort]bool{}
		for _, be := range lb.Backends {
			backends[be.Addr] = true
		}
		for _, of := range obs.Frontends {
			for _, e := range of.Endpoints {
				if !backends[e.Addr] {
					t.Fatalf("%s routes to %s, not a backend of the maps", of.FrontendKey, e.Addr)
				}
			}
		}
		_ = audit.Diff(audit.ExpectedFor(fuzzCiliumState, "cilx"), obs)
	})
}

var fuzzCiliumState = func() *audit.State {
	data, err := os.ReadFile("testdata/scenario/cluster.json")
	if err != nil {
		panic(err)
	}
	st, err := audit.ParseClusterList(data)
	if err != nil {
		panic(err)
	}
	return st
}()

func ciliumObserved(t *testing.T, dir string) *audit.Observed {
	t.Helper()
	lb, err := Decode(readCiliumCapture(t, dir))
	if err != nil {
		t.Fatal(err)
	}
	return lb.Observed()
}

// The genuine agent's maps, judged against the API it programmed them
// from: in sync on every service of the scenario (terminating endpoints
// after the active slots, not-serving ones in no slot, every endpoint
// terminating, Local traffic policies with and without local endpoints,
// the node port's entry per node address, session affinity, a service
// without endpoints, topology hints the agent ignores); and the frozen
// agent's maps (SIGSTOP, then an endpoint left web, one joined dns and
// service late appeared) give exactly those three findings.
func TestCiliumCapturesAgainstTheAPI(t *testing.T) {
	st := readertest.Cluster(t, "testdata/scenario")
	obs := ciliumObserved(t, "testdata/scenario")
	if obs.NoRules || len(obs.Frontends) < 10 || !slices.Equal(obs.Families, []int{4}) {
		t.Fatalf("scenario reduced to %d frontends, families %v, no rules %v", len(obs.Frontends), obs.Families, obs.NoRules)
	}
	if fs := audit.Diff(audit.ExpectedFor(st, "cilx"), obs); len(fs) > 0 {
		t.Fatalf("false findings on the genuine agent's in-sync maps: %+v", fs)
	}
	// Another node's view of the same services differs where the node
	// matters (Local traffic policy): judged as node "other", cilx's
	// maps drift.
	if fs := audit.Diff(audit.ExpectedFor(st, "other"), obs); len(fs) == 0 {
		t.Fatal("cilx's maps judged as node other's: no finding, but its Local scopes hold cilx's endpoints")
	}

	// Dual-stack: both families of one service, an IPv6-only one, a
	// dual-stack node port with externalTrafficPolicy Local (the lb6
	// maps, as the genuine agent writes them).
	dual := ciliumObserved(t, "testdata/dualstack")
	six := 0
	for _, f := range dual.Frontends {
		if f.Family() == 6 {
			six++
		}
	}
	if six < 4 || !slices.Equal(dual.Families, []int{4, 6}) {
		t.Fatalf("dual-stack capture: %d IPv6 frontends, families %v", six, dual.Families)
	}
	if fs := audit.Diff(audit.ExpectedFor(readertest.Cluster(t, "testdata/dualstack"), "cilx"), dual); len(fs) > 0 {
		t.Fatalf("false findings on the genuine agent's dual-stack maps: %+v", fs)
	}

	frozen := readertest.Cluster(t, "testdata/frozen")
	fs := audit.Diff(audit.ExpectedFor(frozen, "cilx"), ciliumObserved(t, "testdata/frozen"))
	readertest.Match(t, "testdata/frozen/findings.json", fs, *update)
	kinds := map[string]audit.Kind{}
	for _, f := range fs {
		kinds[f.Service+" "+f.Endpoint] = f.Kind
	}
	want := map[string]audit.Kind{
		"default/web 198.18.129.11:8080": audit.StaleEndpoint,
		"default/dns 198.18.128.21:5353": audit.MissingEndpoint,
		"default/late ":                  audit.MissingService,
	}
	if !maps.Equal(kinds, want) {
		t.Errorf("frozen agent's findings %v, want %v", kinds, want)
	}
}

// Damaged maps: emptied, a backend gone from under its slots, a master
// gone from under its slots. Each is said (a warning naming the entry)
// and judged (the finding it causes), never read as in sync.
func TestCiliumDamagedMaps(t *testing.T) {
	st := readertest.Cluster(t, "testdata/scenario")
	edit := func(name string, drop func(Entry) bool) (*audit.Observed, []audit.Finding) {
		all := readCiliumCapture(t, "testdata/scenario")
		for i := range all {
			if all[i].Name == name {
				all[i].Entries = slices.DeleteFunc(all[i].Entries, drop)
			}
		}
		lb, err := Decode(all)
		if err != nil {
			t.Fatal(err)
		}
		obs := lb.Observed()
		return obs, audit.Diff(audit.ExpectedFor(st, "cilx"), obs)
	}
	obs, fs := edit(Services4, func(Entry) bool { return true })
	if !obs.NoRules || len(fs) != 1 || fs[0].Kind != audit.NoRules || !strings.Contains(fs[0].Detail, "Cilium") {
		t.Errorf("emptied services map: no rules %v, findings %+v", obs.NoRules, fs)
	}

	// The kubernetes service's backend (198.18.90.1:6443) gone.
	apiserver := hex.EncodeToString([]byte{198, 18, 90, 1, 0x19, 0x2b})
	obs, fs = edit(Backends4, func(e Entry) bool { return strings.HasPrefix(e.Value, apiserver) })
	if len(obs.Warnings) != 1 || !strings.Contains(obs.Warnings[0], "which the backends map lacks") {
		t.Errorf("backend gone: warnings %q", obs.Warnings)
	}
	if len(fs) != 1 || fs[0].Kind != audit.MissingService || fs[0].Service != "default/kubernetes" {
		t.Errorf("backend gone: findings %+v", fs)
	}

	// The kubernetes service's master entry (198.19.0.1:443/TCP, slot 0).
	master := hex.EncodeToString([]byte{198, 19, 0, 1, 0x01, 0xbb, 0, 0, 6, 0, 0, 0})
	obs, fs = edit(Services4, func(e Entry) bool { return e.Key == master })
	if len(obs.Warnings) != 1 || !strings.Contains(obs.Warnings[0], "no master entry") {
		t.Errorf("master gone: warnings %q", obs.Warnings)
	}
	if len(fs) != 1 || fs[0].Kind != audit.MissingService || fs[0].Service != "default/kubernetes" {
		t.Errorf("master gone: findings %+v", fs)
	}
}

// Malformed dumps are refused saying what was expected (`proxyaudit
// diff` takes them through dataplane.ParseRules: dataplane's tests).
func TestParseMapsRefusesMalformedDumps(t *testing.T) {
	for in, says := range map[string]string{
		`[{"name": "cilium_lb4_services_v2", "keySize": 12, "valueSize": 12, "entries": [{"key": "zz", "value": ""}]}]`: "not a 12-byte key",
		`[{"name": "cilium_lb4_backends_v3", "keySize": 4, "valueSize": 12}]`:                                           "no services map",
		`[1, 2]`:                   "a JSON list of maps",
		`[{"name": "cilium_lb4_se`: "a JSON list of maps",
	} {
		if _, err := ParseMaps(strings.NewReader(in)); err == nil || !strings.Contains(err.Error(), says) {
			t.Errorf("%s: %v, want %q", in, err, says)
		}
	}
}

// The internal scope of an externalTrafficPolicy Local frontend (traffic
// from the node's own pods, every endpoint) is judged against the
// cluster's endpoints: a backend gone from it is found, named as the
// internal scope; its key survives the wire.
func TestCiliumInternalScopeJudged(t *testing.T) {
	st := readertest.Cluster(t, "testdata/scenario")
	all := readCiliumCapture(t, "testdata/scenario")
	internal := 0
	for i := range all {
		if all[i].Name == Services4 {
			// 198.18.201.1:8443/TCP, slot 2, internal scope: 198.18.129.31.
			all[i].Entries = slices.DeleteFunc(all[i].Entries, func(e Entry) bool { return e.Key == "c612c90120fb020006010000" })
		}
	}
	lb, err := Decode(all)
	if err != nil {
		t.Fatal(err)
	}
	obs := lb.Observed()
	for _, f := range obs.Frontends {
		if f.Internal {
			internal++
			if k, err := audit.ParseFrontendKey(f.Wire()); err != nil || k != f.FrontendKey {
				t.Errorf("%s: wire %q parses to %v, %v", f.FrontendKey, f.Wire(), k, err)
			}
		}
	}
	// As the aggregator assesses a node (per service, against its
	// versions): the internal scope's drift is the service's.
	h := audit.NewHistory(time.Minute)
	h.Update(st, time.Unix(1_800_000_000, 0))
	as := audit.Assess(st, h, "cilx", obs)
	if len(as) != 1 || as[0].Service != "default/shop" || as[0].State != audit.Divergent || len(as[0].Findings) != 1 {
		t.Errorf("assessed %+v", as)
	}
	for i := range st.Services {
		if svc := &st.Services[i]; svc.Name == "shop" {
			if a := audit.AssessService(st, h, "cilx", obs, "default/shop", svc); a.State != audit.Divergent || len(a.Findings) != 1 {
				t.Errorf("shop assessed alone: %+v", a)
			}
		}
	}
	fs := audit.Diff(audit.ExpectedFor(st, "cilx"), obs)
	if internal < 4 || len(fs) != 1 || fs[0].Kind != audit.MissingEndpoint || fs[0].Endpoint != "198.18.129.31:8443" || fs[0].Scope != audit.ScopeCluster ||
		!strings.Contains(fs[0].Detail, "(internal scope)") {
		t.Errorf("%d internal scopes; findings %+v", internal, fs)
	}
}

// One entry's slot number sized its frontend: slots up to 65535 whatever
// the master's count, and the observed model's endpoints likewise (~43,000
// bytes allocated per input byte: a 16 KB dump took 707 MB through
// ParseRules and audit.Diff; trust review 4, item 6). Slots beyond both the
// master's counts and the slots read are skipped and said; the rest of the
// frontend stands.
func TestCiliumSlotsBoundedByWhatWasRead(t *testing.T) {
	const frontends = 340 // two 24-byte entries each: a 16 KB dump
	var packed []byte
	for i := range frontends {
		for _, slot := range []uint16{0, 65535} {
			k := make([]byte, 12)
			copy(k, []byte{198, 19, byte(i >> 8), byte(i)})
			binary.BigEndian.PutUint16(k[4:], 80)
			binary.NativeEndian.PutUint16(k[6:], slot)
			k[8] = 6 // TCP
			v := make([]byte, 12)
			binary.NativeEndian.PutUint32(v, 7) // backend 7
			if slot == 0 {
				binary.NativeEndian.PutUint16(v[4:], 1) // one active backend
			}
			packed = append(append(packed, k...), v...)
		}
	}
	dump := []MapDump{{Name: Services4, KeySize: 12, ValueSize: 12, Packed: packed},
		{Name: Backends4, KeySize: 4, ValueSize: 12}}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	lb, err := Decode(dump)
	if err != nil {
		t.Fatal(err)
	}
	obs := lb.Observed()
	runtime.ReadMemStats(&after)
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > readertest.AllocBase+readertest.AllocPerByte*uint64(len(packed)) {
		t.Errorf("%d bytes of entries allocated %d KB (%d per byte; the bound is %d)", len(packed), alloc>>10, alloc/uint64(len(packed)), readertest.AllocPerByte)
	}
	for _, f := range lb.Frontends {
		if len(f.Slots) > 1 {
			t.Fatalf("%s: %d slots from two entries", f.Addr, len(f.Slots))
		}
	}
	if len(obs.Warnings) == 0 || !strings.Contains(obs.Warnings[0], "slot 65535 beyond") {
		t.Errorf("the skipped slots are not said: %q", obs.Warnings)
	}
}
