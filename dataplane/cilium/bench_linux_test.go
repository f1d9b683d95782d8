package cilium

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// synthLB is a node's LB maps in Cilium's v1.18–v1.20 layout (the
// layout the captures of the genuine agent prove): services cluster
// IPs, each with a wildcard entry, a master and per backends slots, every
// backend of its own. For measuring reads at scale only: what the entries
// mean is proved on the agent's own maps (audit's capture tests).
func synthLB(services, per int) []MapDump {
	svc := MapDump{Name: Services4, KeySize: 12, ValueSize: 12}
	be := MapDump{Name: Backends4, KeySize: 4, ValueSize: 12}
	rev := MapDump{Name: RevNat4, KeySize: 2, ValueSize: 6}
	add := func(d *MapDump, k, v []byte) {
		d.Entries = append(d.Entries, Entry{Key: hex.EncodeToString(k), Value: hex.EncodeToString(v)})
	}
	id := uint32(0)
	for i := range services {
		ip := []byte{198, 19, byte(i >> 8), byte(i)}
		key := func(port, slot uint16, proto byte) []byte {
			k := make([]byte, 12)
			copy(k, ip)
			binary.BigEndian.PutUint16(k[4:], port)
			binary.NativeEndian.PutUint16(k[6:], slot)
			k[8] = proto
			return k
		}
		val := func(backend uint32, count int, flags byte) []byte {
			v := make([]byte, 12)
			binary.NativeEndian.PutUint32(v[0:], backend)
			binary.NativeEndian.PutUint16(v[4:], uint16(count))
			binary.BigEndian.PutUint16(v[6:], uint16(i+1))
			v[8] = flags
			return v
		}
		add(&svc, key(0, 0, 0), val(0, 0, 0))
		add(&svc, key(80, 0, 6), val(0, per, 0))
		for s := range per {
			id++
			add(&svc, key(80, uint16(s+1), 6), val(id, 0, 0))
			v := make([]byte, 12)
			copy(v, []byte{198, 18 + byte(id>>16), byte(id >> 8), byte(id)})
			binary.BigEndian.PutUint16(v[4:], 8080)
			v[6] = 6
			k := make([]byte, 4)
			binary.NativeEndian.PutUint32(k, id)
			add(&be, k, v)
		}
		k := make([]byte, 2)
		binary.BigEndian.PutUint16(k, uint16(i+1))
		v := make([]byte, 6)
		copy(v, ip)
		binary.BigEndian.PutUint16(v[4:], 80)
		add(&rev, k, v)
	}
	return []MapDump{svc, be, rev}
}

// BenchmarkReadAt10kServices reads a node's LB maps at 10k services and
// 100k backends (120k service entries) as the collector does (every map
// read-only, decoded, reduced to the audit's model), side by side with
// the agent's own tool reading the same pinned maps (`cilium-dbg bpf lb
// list`, which only prints them). cilium-dbg reads the first BPF
// filesystem mounted, so no other may be mounted while it runs; it is
// built by deploy/k8s-tools/cilium.sh (make e2e-cilium).
func BenchmarkReadAt10kServices(b *testing.B) {
	root := b.TempDir()
	if err := unix.Mount("bpf", root, "bpf", 0, ""); err != nil {
		b.Skipf("cannot mount a BPF filesystem (%v): needs root", err)
	}
	b.Cleanup(func() { unix.Unmount(root, 0) })
	if err := Pin(root, synthLB(10_000, 10)); err != nil {
		b.Fatal(err)
	}
	cpu := func() time.Duration {
		var self, child syscall.Rusage
		syscall.Getrusage(syscall.RUSAGE_SELF, &self)
		syscall.Getrusage(syscall.RUSAGE_CHILDREN, &child)
		return time.Duration(self.Utime.Nano() + self.Stime.Nano() + child.Utime.Nano() + child.Stime.Nano())
	}
	b.Run("proxyaudit", func(b *testing.B) {
		start := cpu()
		for b.Loop() {
			dumps, err := Read(root)
			if err != nil {
				b.Fatal(err)
			}
			lb, err := Decode(dumps)
			if err != nil {
				b.Fatal(err)
			}
			if obs := lb.Observed(); len(obs.Frontends) != 10_000 || len(obs.Frontends[0].Endpoints) != 10 {
				b.Fatalf("%d frontends", len(obs.Frontends))
			}
		}
		b.ReportMetric(float64(cpu()-start)/float64(b.N)/1e6, "cpu-ms/op")
	})
	// The fallback for kernels before batch lookups, side by side: the
	// same maps one entry at a time (two system calls an entry).
	b.Run("proxyaudit-iterating", func(b *testing.B) {
		start := cpu()
		for b.Loop() {
			var dumps []MapDump
			for _, name := range []string{Services4, Backends4, RevNat4} {
				m, err := ebpf.LoadPinnedMap(filepath.Join(root, Globals, name), &ebpf.LoadPinOptions{ReadOnly: true})
				if err != nil {
					b.Fatal(err)
				}
				packed, err := iterate(m)
				dumps = append(dumps, MapDump{Name: name, KeySize: int(m.KeySize()), ValueSize: int(m.ValueSize()), Packed: packed})
				m.Close()
				if err != nil {
					b.Fatal(err)
				}
			}
			lb, err := Decode(dumps)
			if err != nil {
				b.Fatal(err)
			}
			if obs := lb.Observed(); len(obs.Frontends) != 10_000 {
				b.Fatalf("%d frontends", len(obs.Frontends))
			}
		}
		b.ReportMetric(float64(cpu()-start)/float64(b.N)/1e6, "cpu-ms/op")
	})
	b.Run("cilium-dbg", func(b *testing.B) {
		dbg := ciliumDbg(b)
		if others := otherBPFMounts(root); len(others) > 0 {
			b.Skipf("another BPF filesystem is mounted (%v): cilium-dbg would read that one", others)
		}
		start := cpu()
		for b.Loop() {
			var out bytes.Buffer
			cmd := exec.Command(dbg, "bpf", "lb", "list")
			cmd.Stdout = &out
			if err := cmd.Run(); err != nil {
				b.Fatal(err)
			}
			if n := bytes.Count(out.Bytes(), []byte("\n")); n < 120_000 {
				b.Fatalf("cilium-dbg printed %d lines", n)
			}
		}
		b.ReportMetric(float64(cpu()-start)/float64(b.N)/1e6, "cpu-ms/op")
	})
}

// ciliumDbg is the genuine cilium-dbg, built (or found cached) by
// deploy/k8s-tools/cilium.sh.
func ciliumDbg(b *testing.B) string {
	script, err := filepath.Abs("../../deploy/k8s-tools/cilium.sh")
	if err != nil {
		b.Fatal(err)
	}
	out, err := exec.Command(script).Output()
	if err != nil {
		b.Skipf("the genuine cilium-dbg is not built (%v): deploy/k8s-tools/cilium.sh builds it (~6 min)", err)
	}
	return filepath.Join(strings.TrimSpace(string(out)), "bin", "cilium-dbg")
}

func otherBPFMounts(root string) []string {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		pre, post, ok := strings.Cut(l, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if ok && len(f) > 4 && len(g) > 0 && g[0] == "bpf" && f[4] != root {
			out = append(out, f[4])
		}
	}
	return out
}
