package audit

import (
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

func readCiliumCapture(t testing.TB, dir string) []CiliumMapDump {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "maps.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d []CiliumMapDump
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
	dirs, _ := filepath.Glob("testdata/cilium/*")
	if len(dirs) == 0 {
		t.Fatal("no captures in testdata/cilium (deploy/cilium/capture.sh makes them)")
	}
	space := regexp.MustCompile(`\s+`)
	backend := regexp.MustCompile(`(\d+) => (\S+)/(TCP|UDP|SCTP) \((\w+)\)`)
	for _, dir := range dirs {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			lb, err := DecodeCilium(readCiliumCapture(t, dir))
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
			if seen == 0 || len(lb.Families) != 1 || lb.Families[0] != 4 {
				t.Errorf("%d backends in the service list, families %v", seen, lb.Families)
			}
		})
	}
}

// A map of another layout, or entries that are not of its sizes, is an
// error naming the map: never a guess.
func TestCiliumLayoutsAreKnownNotGuessed(t *testing.T) {
	good := readCiliumCapture(t, "testdata/cilium/scenario")
	for name, mutate := range map[string]func(d []CiliumMapDump){
		"a services value of 16 bytes": func(d []CiliumMapDump) { d[0].ValueSize = 16 },
		"a key that is not hex":        func(d []CiliumMapDump) { d[0].Entries[0].Key = "zz" + d[0].Entries[0].Key[2:] },
		"a value one byte short":       func(d []CiliumMapDump) { d[0].Entries[0].Value = d[0].Entries[0].Value[2:] },
	} {
		d := make([]CiliumMapDump, len(good))
		for i := range good {
			d[i] = good[i]
			d[i].Entries = slices.Clone(good[i].Entries)
		}
		if d[0].Name != CiliumServices4 {
			t.Fatalf("the capture's first map is %s", d[0].Name)
		}
		mutate(d)
		if _, err := DecodeCilium(d); err == nil || !strings.Contains(err.Error(), CiliumServices4) {
			t.Errorf("%s: %v, want an error naming %s", name, err, CiliumServices4)
		}
	}
	// A map proxyaudit does not read (another of Cilium's) is ignored.
	if _, err := DecodeCilium(append(slices.Clone(good), CiliumMapDump{Name: "cilium_lb4_maglev", KeySize: 2, ValueSize: 4})); err != nil {
		t.Error(err)
	}
}

// Any bytes of the known sizes decode without panicking, into frontends
// whose slots never exceed what was read.
func FuzzDecodeCilium(f *testing.F) {
	for _, d := range readCiliumCapture(f, "testdata/cilium/scenario") {
		for _, e := range d.Entries[:min(3, len(d.Entries))] {
			k, _ := hex.DecodeString(e.Key)
			v, _ := hex.DecodeString(e.Value)
			f.Add(d.Name, k, v)
		}
	}
	f.Fuzz(func(t *testing.T, name string, k, v []byte) {
		sizes, ok := ciliumLayouts[name]
		if !ok {
			return
		}
		k = append(k, make([]byte, max(0, sizes[0]-len(k)))...)[:sizes[0]]
		v = append(v, make([]byte, max(0, sizes[1]-len(v)))...)[:sizes[1]]
		lb, err := DecodeCilium([]CiliumMapDump{{Name: name, KeySize: sizes[0], ValueSize: sizes[1], Entries: []CiliumEntry{{Key: hex.EncodeToString(k), Value: hex.EncodeToString(v)}}}})
		if err != nil {
			t.Fatal(err)
		}
		for _, fr := range lb.Frontends {
			if len(fr.Slots) > 1<<16 {
				t.Fatalf("%d slots from one entry", len(fr.Slots))
			}
		}
		_ = lb.Lines()
	})
}
