package collector

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/nftables"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// collectorBinary builds proxyaudit-collector once per test run.
func collectorBinary(t testing.TB) string {
	t.Helper()
	binOnce.Do(func() {
		root, err := localcluster.RepoRoot()
		if err != nil {
			binErr = err
			return
		}
		dir, err := os.MkdirTemp("", "proxyaudit-collector-bin")
		if err != nil {
			binErr = err
			return
		}
		binPath = filepath.Join(dir, "proxyaudit-collector")
		if out, err := localcluster.GoBuild(context.Background(), root, binPath, "./cmd/proxyaudit-collector").CombinedOutput(); err != nil {
			binErr = fmt.Errorf("build: %v\n%s", err, out)
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binPath
}

// stub is an aggregator that welcomes one collector and records its
// reports with the time each arrived.
type stub struct {
	ln      net.Listener
	mu      sync.Mutex
	reports []received
	changed chan struct{}
}

type received struct {
	at time.Time
	r  *stream.Report
}

func startStub(t *testing.T, ip string) *stub {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	s := &stub{ln: ln, changed: make(chan struct{}, 1)}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go s.serve(c)
		}
	}()
	return s
}

func (s *stub) serve(c net.Conn) {
	defer c.Close()
	if m, _, err := stream.Read(c, 1<<20); err != nil || m.Type != stream.TypeHello {
		return
	}
	if stream.Write(c, &stream.Message{Type: stream.TypeWelcome}) != nil {
		return
	}
	for {
		m, _, err := stream.Read(c, 64<<20)
		if err != nil {
			return
		}
		if m.Report == nil {
			continue
		}
		s.mu.Lock()
		s.reports = append(s.reports, received{at: time.Now(), r: m.Report})
		s.mu.Unlock()
		select {
		case s.changed <- struct{}{}:
		default:
		}
	}
}

// wait returns the first report from index from on that satisfies cond,
// and its index.
func (s *stub) wait(t testing.TB, from int, d time.Duration, what string, cond func(received) bool) (received, int) {
	t.Helper()
	deadline := time.After(d)
	for {
		s.mu.Lock()
		for i := from; i < len(s.reports); i++ {
			if cond(s.reports[i]) {
				got := s.reports[i]
				s.mu.Unlock()
				return got, i
			}
		}
		s.mu.Unlock()
		select {
		case <-s.changed:
		case <-deadline:
			t.Fatalf("no report %s within %s", what, d)
		}
	}
}

func (s *stub) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.reports)
}

// reads is the total of the last read stats a collector sent up to index i.
func (s *stub) reads(i int) (map[stream.ReadReason]uint64, uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for ; i >= 0; i-- {
		if rs := s.reports[i].r.Reads; rs != nil {
			var total uint64
			for _, n := range rs.Reads {
				total += n
			}
			return rs.Reads, total
		}
	}
	return nil, 0
}

// runCollector starts the real collector binary in n's network namespace,
// streaming to s.
func runCollector(t *testing.T, n *localcluster.Node, s *stub, args ...string) *localcluster.Process {
	t.Helper()
	argv := append([]string{collectorBinary(t), "--node-name", n.Name, "--aggregator", s.ln.Addr().String()}, args...)
	p, err := n.StartProcess("signal-collector-"+n.Name, argv...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Stop)
	return p
}

// sigService is a service of two endpoints every node's kube-proxy
// programs; its second endpoint comes and goes.
func sigService(ctx context.Context, t *testing.T, c *localcluster.Cluster) (apply func(ips ...string)) {
	t.Helper()
	svc, err := c.CreateService(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "sig", Name: "web"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}}})
	if err != nil && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	if svc == nil || svc.Spec.ClusterIP == "" {
		svc, err = c.Client.CoreV1().Services("sig").Get(ctx, "web", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
	}
	return func(ips ...string) {
		t.Helper()
		if err := c.ApplySlice(ctx, localcluster.Slice(svc, "web-1", "http", 8080, corev1.ProtocolTCP, ips...)); err != nil {
			t.Fatal(err)
		}
		for _, n := range c.Nodes() {
			if err := n.WaitRules(ctx, time.Minute, "the sig/web endpoints", func(rules string) bool {
				for _, ip := range ips {
					if !strings.Contains(rules, ip) {
						return false
					}
				}
				return true
			}); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// On a quiet node the collector sends heartbeats and reads nothing, in
// both nf_tables modes (iptables-nft and nftables); a change kube-proxy
// commits, and a flush by hand, are reported within seconds, not at the
// next interval.
func TestE2EChangeDrivenReads(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	apply := sigService(ctx, t, c)
	apply("198.18.130.1", "198.18.130.2")
	for _, name := range []string{"col-ipt", "col-nft"} {
		n := c.Node(name)
		t.Run(name, func(t *testing.T) {
			// Quiet: five heartbeats, no read after the first.
			s := startStub(t, n.HostIP)
			p := runCollector(t, n, s, "--interval", "1s")
			_, first := s.wait(t, 0, 30*time.Second, "with the first read", func(r received) bool { return r.r.Reads != nil })
			_, before := s.reads(first)
			s.wait(t, first+5, 30*time.Second, "five heartbeats later", func(received) bool { return true })
			if _, after := s.reads(s.count() - 1); after != before {
				t.Fatalf("a quiet node was read %d more time(s) in five intervals", after-before)
			}
			p.Stop()

			// The interval is now 30 s: what arrives sooner was announced.
			s = startStub(t, n.HostIP)
			runCollector(t, n, s, "--interval", "30s")
			r0, i := s.wait(t, 0, 30*time.Second, "with the first read", func(r received) bool { return r.r.Reads != nil })
			// Reads start at least a second apart: let the gap pass, so
			// that what follows measures the signal, not the gap.
			time.Sleep(1500 * time.Millisecond)
			changed := time.Now()
			apply("198.18.130.1")
			r1, i := s.wait(t, i+1, 10*time.Second, "showing kube-proxy's change", func(r received) bool { return r.r.Root != r0.r.Root })
			reads, _ := s.reads(i)
			t.Logf("%s: the API change reached the aggregator %s later (kube-proxy's own sync included); reads %v", name, r1.at.Sub(changed).Round(time.Millisecond), reads)
			if reads[stream.ReadChange] == 0 {
				t.Errorf("the change was not read as a change: %v", reads)
			}

			time.Sleep(1500 * time.Millisecond)
			flushed := time.Now()
			if err := n.FlushRules(ctx); err != nil {
				t.Fatal(err)
			}
			r2, _ := s.wait(t, i+1, 5*time.Second, "showing the flush", func(r received) bool { return r.r.NoRules })
			t.Logf("%s: a flush by hand reached the aggregator %s later", name, r2.at.Sub(flushed).Round(time.Millisecond))
			if err := n.RestartProxy(ctx); err != nil {
				t.Fatal(err)
			}
			apply("198.18.130.1", "198.18.130.2")
		})
	}
}

// On the legacy backend the change signal is the nat table's size and
// entry count, completed by kube-proxy's own last-sync time: a pod
// replaced by another (same size) is read as soon as kube-proxy synced it,
// and a flush within a second; but a hand rewrite of one DNAT to an
// address of the same length keeps both, and only the full read every
// --full-read-interval finds it (documented in docs/design.md).
func TestE2ELegacySameSizeTamperFoundByBackstop(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	apply := sigService(ctx, t, c)
	apply("198.18.130.1", "198.18.130.2")
	n := c.Node("col-legacy")
	s := startStub(t, n.HostIP)
	const backstop = 20 * time.Second
	runCollector(t, n, s, "--interval", "1s", "--full-read-interval", backstop.String())
	r0, i := s.wait(t, 0, 30*time.Second, "with the first read", func(r received) bool { return r.r.Reads != nil })

	// kube-proxy replaces a pod: the table keeps its size.
	swapped := time.Now()
	apply("198.18.130.1", "198.18.130.3")
	r1, i := s.wait(t, i+1, 10*time.Second, "showing the replaced pod", func(r received) bool { return r.r.Root != r0.r.Root })
	reads, _ := s.reads(i)
	t.Logf("pod replaced by kube-proxy: seen %s after the API change; reads %v", r1.at.Sub(swapped).Round(time.Millisecond), reads)
	if reads[stream.ReadBackstop] != 0 || reads[stream.ReadChange] == 0 {
		t.Errorf("kube-proxy's rewrite was not read as a change: %v", reads)
	}

	// A hand rewrite of the same size, right after a read: only the
	// backstop sees it.
	if err := n.TamperEndpoint(ctx, "198.18.130.3:8080", "198.18.130.9:8080"); err != nil {
		t.Fatal(err)
	}
	tampered := time.Now()
	r2, j := s.wait(t, i+1, backstop+10*time.Second, "showing the tamper", func(r received) bool { return r.r.Root != r1.r.Root })
	reads, _ = s.reads(j)
	t.Logf("same-size tamper by hand: seen %s after it was made (backstop %s); reads %v", r2.at.Sub(tampered).Round(time.Millisecond), backstop, reads)
	if reads[stream.ReadBackstop] == 0 {
		t.Errorf("the tamper was not found by a backstop read: %v", reads)
	}

	// A flush changes the table's size: seen within seconds.
	flushed := time.Now()
	if err := n.FlushRules(ctx); err != nil {
		t.Fatal(err)
	}
	r3, _ := s.wait(t, j+1, 5*time.Second, "showing the flush", func(r received) bool { return r.r.NoRules })
	t.Logf("legacy flush seen %s after it was made", r3.at.Sub(flushed).Round(time.Millisecond))
	if err := n.RestartProxy(ctx); err != nil {
		t.Fatal(err)
	}
	apply("198.18.130.1", "198.18.130.2")
}

// A burst of thousands of commits while the collector cannot read its
// notifications (stopped) overruns its socket: the kernel drops the
// announcements, the collector says so and checks the generation, and the
// change hidden in the burst is reported at once, not at the interval.
func TestE2ESignalOverrunLosesNoChange(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	apply := sigService(ctx, t, c)
	apply("198.18.130.1", "198.18.130.2")
	n := c.Node("col-nft")
	s := startStub(t, n.HostIP)
	// The kernel's default buffer: the default 16 MiB takes ten times the
	// commits (minutes) to overrun, and proves nothing more.
	p := runCollector(t, n, s, "--interval", "30s", "--notification-buffer-mib", "0")
	r0, i := s.wait(t, 0, 30*time.Second, "with the first read", func(r received) bool { return r.r.Reads != nil })

	if err := syscall.Kill(p.PID(), syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	ns, err := os.Open("/run/netns/" + n.NetNS)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	conn, err := nftables.New(nftables.WithNetNSFd(int(ns.Fd())))
	if err != nil {
		t.Fatal(err)
	}
	table := conn.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: "pa-burst"})
	set := &nftables.Set{Table: table, Name: "s", KeyType: nftables.TypeInetService}
	if err := conn.AddSet(set, nil); err != nil {
		t.Fatal(err)
	}
	if err := conn.Flush(); err != nil {
		t.Fatal(err)
	}
	// The burst goes on until the kernel itself counts drops on the
	// collector's subscription (how many commits that takes depends on
	// the machine's net.core.rmem_default), then the change is made, then
	// as many commits again: the change's announcement is surely lost.
	commit := func(k int) {
		t.Helper()
		elem := []nftables.SetElement{{Key: []byte{byte(k >> 8), byte(k)}}}
		if k%2 == 0 {
			err = conn.SetAddElements(set, elem)
		} else {
			err = conn.SetDeleteElements(set, []nftables.SetElement{{Key: []byte{byte((k - 1) >> 8), byte(k - 1)}}})
		}
		if err == nil {
			err = conn.Flush()
		}
		if err != nil {
			t.Fatalf("commit %d: %v", k, err)
		}
	}
	const maxCommits = 200_000
	commits := 0
	for ; ; commits++ {
		if commits%500 == 0 {
			drops, err := subscriptionDrops(p.PID())
			if err != nil {
				t.Fatal(err)
			}
			if drops > 0 {
				break
			}
			if commits >= maxCommits {
				t.Fatalf("%d commits did not overrun the collector's nf_tables subscription (no drops in /proc/%d/net/netlink)", commits, p.PID())
			}
		}
		commit(commits)
	}
	if err := n.TamperEndpoint(ctx, "198.18.130.2:8080", "198.18.130.9:8080"); err != nil {
		t.Fatal(err)
	}
	for k := range commits {
		commit(k)
	}
	commits *= 2
	conn.DelTable(table)
	if err := conn.Flush(); err != nil {
		t.Fatal(err)
	}
	resumed := time.Now()
	if err := syscall.Kill(p.PID(), syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	r1, _ := s.wait(t, i+1, 10*time.Second, "showing the change hidden in the burst", func(r received) bool { return r.r.Root != r0.r.Root })
	t.Logf("after %d commits with the collector stopped: the change reported %s after it resumed; %+v",
		commits, r1.at.Sub(resumed).Round(time.Millisecond), r1.r.Reads)
	// The collector says announcements were lost: in that report, or
	// (when notifications queued before the overrun woke it first, and
	// the kernel's ENOBUFS came on the next receive) in a later one.
	if rs := r1.r.Reads; rs == nil || rs.SignalLost == 0 {
		s.wait(t, i+1, 45*time.Second, "saying announcements were lost (the kernel counted drops)", func(r received) bool {
			return r.r.Reads != nil && r.r.Reads.SignalLost > 0
		})
	}
	if err := n.RestartProxy(ctx); err != nil {
		t.Fatal(err)
	}
	apply("198.18.130.1", "198.18.130.2")
}

// subscriptionDrops is what the kernel counts as dropped on a process's
// nf_tables multicast subscriptions: /proc/PID/net/netlink lists the
// sockets of its network namespace (protocol 12 is NETLINK_NETFILTER,
// group bit 0x40 NFNLGRP_NFTABLES), matched to the process's own
// descriptors by inode.
func subscriptionDrops(pid int) (uint64, error) {
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return 0, err
	}
	mine := map[string]bool{}
	for _, fd := range fds {
		if l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name())); err == nil && strings.HasPrefix(l, "socket:[") {
			mine[strings.TrimSuffix(strings.TrimPrefix(l, "socket:["), "]")] = true
		}
	}
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/netlink", pid))
	if err != nil {
		return 0, err
	}
	var drops uint64
	found := false
	for _, line := range strings.Split(string(data), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) < 10 || f[1] != "12" || !mine[f[9]] {
			continue
		}
		groups, err1 := strconv.ParseUint(f[3], 16, 32)
		d, err2 := strconv.ParseUint(f[8], 10, 64)
		if err1 != nil || err2 != nil || groups&0x40 == 0 {
			continue
		}
		found, drops = true, drops+d
	}
	if !found {
		return 0, fmt.Errorf("process %d has no nf_tables subscription in /proc/%d/net/netlink", pid, pid)
	}
	return drops, nil
}
