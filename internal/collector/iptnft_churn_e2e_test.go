package collector

import (
	"context"
	"crypto/sha256"
	"encoding/base32"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/iptables"
	"github.com/proxyaudit/proxyaudit/dataplane/nl"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// churnTable is a kube-proxy-shaped nat table the test changes at random,
// in one family: services with cluster IPs and endpoint chains.
type churnTable struct {
	fam      int
	services [][]churnEndpoint
	serial   int
	rng      *rand.Rand
}

type churnEndpoint struct {
	sep string
	ip  netip.Addr
}

func (c *churnTable) clusterIP(i int) string {
	if c.fam == 6 {
		return fmt.Sprintf("2001:2:0:ffff::%x", 0x100+i)
	}
	return fmt.Sprintf("198.19.%d.%d", i/250, 1+i%250)
}

func (c *churnTable) prefix() string {
	if c.fam == 6 {
		return "/128"
	}
	return "/32"
}

func (c *churnTable) svcChain(i int) string {
	return fmt.Sprintf("KUBE-SVC-%s", hashName(fmt.Sprintf("%d/svc/%d", c.fam, i)))
}

func hashName(s string) string {
	h := sha256.Sum256([]byte(s))
	return base32.StdEncoding.EncodeToString(h[:])[:16]
}

func (c *churnTable) newEndpoints(i int) []churnEndpoint {
	n := c.rng.IntN(5)
	var out []churnEndpoint
	for range n {
		c.serial++
		var ip netip.Addr
		if c.fam == 6 {
			ip = netip.MustParseAddr(fmt.Sprintf("2001:2:0:8000::%x", c.serial))
		} else {
			ip = netip.AddrFrom4([4]byte{198, 18, byte(128 + c.serial/250%100), byte(1 + c.serial%250)})
		}
		out = append(out, churnEndpoint{sep: "KUBE-SEP-" + hashName(fmt.Sprintf("%d/%d/%s", c.fam, i, ip)), ip: ip})
	}
	return out
}

func (c *churnTable) dnatTarget(ip netip.Addr) string {
	return netip.AddrPortFrom(ip, 8080).String()
}

// sync is an iptables-restore input of kube-proxy's shape: KUBE-SERVICES
// rewritten whole, the changed services' chains declared (which flushes
// them) and written, their stale endpoint chains deleted; all services'
// chains when full.
func (c *churnTable) sync(changed []int, full bool) string {
	var chains, rules strings.Builder
	chains.WriteString("*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n")
	rules.WriteString("-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n")
	for i := range c.services {
		fmt.Fprintf(&rules, "-A KUBE-SERVICES -d %s%s -p tcp -m comment --comment \"ns/s%d:http cluster IP\" -m tcp --dport 80 -j %s\n",
			c.clusterIP(i), c.prefix(), i, c.svcChain(i))
	}
	if c.fam == 4 {
		rules.WriteString("-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n")
		fmt.Fprintf(&rules, "-A KUBE-NODEPORTS -p tcp -m comment --comment \"ns/s0:http\" -m tcp --dport 30080 -j %s\n", c.svcChain(0))
	}
	var stale []string
	write := func(i int) {
		fmt.Fprintf(&chains, ":%s - [0:0]\n", c.svcChain(i))
		eps := c.services[i]
		for k, e := range eps {
			fmt.Fprintf(&chains, ":%s - [0:0]\n", e.sep)
			fmt.Fprintf(&rules, "-A %s -s %s%s -j KUBE-MARK-MASQ\n", e.sep, e.ip, c.prefix())
			fmt.Fprintf(&rules, "-A %s -p tcp -m tcp -j DNAT --to-destination %s\n", e.sep, c.dnatTarget(e.ip))
			if k < len(eps)-1 {
				fmt.Fprintf(&rules, "-A %s -m statistic --mode random --probability 0.5 -j %s\n", c.svcChain(i), e.sep)
			} else {
				fmt.Fprintf(&rules, "-A %s -j %s\n", c.svcChain(i), e.sep)
			}
		}
	}
	for _, i := range changed {
		for _, e := range c.services[i] {
			stale = append(stale, e.sep)
		}
		c.services[i] = c.newEndpoints(i)
	}
	if full {
		for i := range c.services {
			write(i)
		}
	} else {
		for _, i := range changed {
			write(i)
		}
	}
	for _, s := range stale {
		// Declared (flushed) and deleted, as kube-proxy does.
		fmt.Fprintf(&chains, ":%s - [0:0]\n", s)
		fmt.Fprintf(&rules, "-X %s\n", s)
	}
	return chains.String() + rules.String() + "COMMIT\n"
}

// TestE2EIPTablesIncrementalEqualsWholeRead drives a real kernel through
// hundreds of random commits of every kind the collector meets (kube-
// proxy's partial and full syncs, a DNAT rewritten by hand, rules deleted,
// inserted before the others and flushed, the whole table flushed, chains
// of other owners, both families) and checks after each that the model the
// reader kept up to date from notifications, with only the changes it
// reported applied, is the model of a whole read, and now and then that it
// is what iptables-save prints.
func TestE2EIPTablesIncrementalEqualsWholeRead(t *testing.T) {
	localcluster.NeedRoot(t, false)
	t.Run("nf_tables", func(t *testing.T) { incrementalChurn(t, false) })
	t.Run("legacy", func(t *testing.T) { incrementalChurn(t, true) })
}

// iptChurn is one run of TestE2EIPTablesIncrementalEqualsWholeRead: the
// tables a scratch namespace holds, and the reader kept up to date with
// them.
type iptChurn struct {
	t      *testing.T
	ctx    context.Context
	ns     *localcluster.Scratch
	rng    *rand.Rand
	legacy bool
	tables map[int]*churnTable
	src    Source
	r      ChangeReader
	sig    *nl.GenSignal
	tok0   uint64
	// state is the model kept from the reader's changes alone.
	state *stream.State
}

func incrementalChurn(t *testing.T, legacy bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	ns, err := localcluster.NewScratch(ctx, "iptchurn")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	c := &iptChurn{t: t, ctx: ctx, ns: ns, rng: rand.New(rand.NewPCG(7, 11)), legacy: legacy, tables: map[int]*churnTable{},
		src: Source{Mode: audit.ModeIPTables, Legacy: legacy}}
	for _, fam := range []int{4, 6} {
		c.tables[fam] = &churnTable{fam: fam, rng: c.rng, services: make([][]churnEndpoint, map[int]int{4: 60, 6: 15}[fam])}
		for i := range c.tables[fam].services {
			c.tables[fam].services[i] = c.tables[fam].newEndpoints(i)
		}
	}
	for fam, tb := range c.tables {
		c.restore(fam, tb.sync(nil, true))
	}
	c.ipt(4, "-N", "CNI-OTHER")
	c.open()
	if c.sig != nil {
		defer c.sig.Close()
	}
	c.read(0, "first read")
	counts := map[string]int{}
	for round := 1; round <= 240; round++ {
		var did []string
		for range 1 + c.rng.IntN(3) {
			fam := 4
			if c.rng.IntN(5) == 0 {
				fam = 6
			}
			i := c.rng.IntN(len(c.tables[fam].services))
			kinds := []string{"sync", "sync", "sync", "tamper", "delete", "insert", "flush-chain", "noise", "full", "flush-table", "delete-chain",
				"insert-middle", "replace-dispatch", "delete-dispatch", "port"}
			kind := kinds[c.rng.IntN(len(kinds))]
			if !c.commit(kind, fam, i) {
				continue
			}
			did = append(did, fmt.Sprintf("%s/%d", kind, fam))
			counts[kind]++
		}
		if round == 120 && !legacy {
			c.r.(NotificationSink).Lost() // as after an overrun: the next read is whole, and still agrees
			did = append(did, "lost")
		}
		c.read(round, strings.Join(did, " "))
	}
	c.summary(counts)
}

func (c *iptChurn) toolOf(fam int) string {
	suffix := ""
	if c.legacy {
		suffix = "-legacy"
	}
	return map[int]string{4: "iptables", 6: "ip6tables"}[fam] + suffix
}

func (c *iptChurn) restore(fam int, input string) {
	c.t.Helper()
	tool := c.toolOf(fam) + "-restore"
	cmd := c.ns.Command(c.ctx, tool, "--noflush")
	cmd.Stdin = strings.NewReader(input)
	if out, err := cmd.CombinedOutput(); err != nil {
		c.t.Fatalf("%s: %v: %s\n%s", tool, err, out, input)
	}
}

func (c *iptChurn) ipt(fam int, args ...string) {
	c.t.Helper()
	tool := c.toolOf(fam)
	if out, err := c.ns.Exec(c.ctx, append([]string{tool, "-t", "nat"}, args...)...); err != nil {
		c.t.Fatalf("%s %v: %v: %s", tool, args, err, out)
	}
}

// try runs a command that may fail (a chain a flush emptied).
func (c *iptChurn) try(fam int, args ...string) {
	c.ns.Exec(c.ctx, append([]string{c.toolOf(fam), "-t", "nat"}, args...)...)
}

func (c *iptChurn) inNS(f func() error) {
	c.t.Helper()
	if err := localcluster.InNetNS(c.ns.NetNS, f); err != nil {
		c.t.Fatal(err)
	}
}

// open makes the reader in the namespace, fed by the nf_tables signal
// (the legacy backend has no notifications: every read compares the
// table).
func (c *iptChurn) open() {
	c.inNS(func() error {
		c.r = NewHost().Reader(c.src).(ChangeReader)
		if c.legacy {
			return nil
		}
		s, err := nl.OpenGenSignal(DefaultNotifyBuffer)
		if err != nil {
			return err
		}
		c.sig = s
		c.sig.Feed(c.r.(NotificationSink))
		return nil
	})
	if c.sig != nil {
		var err error
		if c.tok0, err = c.sig.Token(); err != nil {
			c.t.Fatal(err)
		}
	}
}

// commit makes one random commit of the kind on family fam, about
// service i; false when there was nothing to do.
func (c *iptChurn) commit(kind string, fam, i int) bool {
	tb := c.tables[fam]
	rng := c.rng
	switch kind {
	case "sync":
		var changed []int
		for range 1 + rng.IntN(8) {
			changed = append(changed, rng.IntN(len(tb.services)))
		}
		c.restore(fam, tb.sync(uniqueInts(changed), false))
	case "full":
		c.restore(fam, tb.sync(nil, true))
	case "tamper":
		if eps := tb.services[i]; len(eps) > 0 {
			e := eps[rng.IntN(len(eps))]
			other := tb.services[rng.IntN(len(tb.services))]
			if len(other) == 0 {
				return false
			}
			// Fails when a flush emptied the chain: then nothing to tamper.
			c.try(fam, "-R", e.sep, "2", "-p", "tcp", "-m", "tcp", "-j", "DNAT", "--to-destination", tb.dnatTarget(other[0].ip))
		}
	case "delete":
		c.try(fam, "-D", tb.svcChain(i), "1")
	case "insert":
		j := rng.IntN(len(tb.services))
		c.ipt(fam, "-I", "KUBE-SERVICES", "1", "-d", tb.clusterIP(i)+tb.prefix(), "-p", "tcp", "-m", "tcp", "--dport", "80", "-j", tb.svcChain(j))
	case "insert-middle", "replace-dispatch":
		// After the third rule, or in place of the second:
		// notifications that name the rule before.
		j := rng.IntN(len(tb.services))
		op := map[string]string{"insert-middle": "-I", "replace-dispatch": "-R"}[kind]
		c.try(fam, op, "KUBE-SERVICES", []string{"4", "2"}[rng.IntN(2)], "-d", tb.clusterIP(i)+tb.prefix(), "-p", "tcp", "-m", "tcp", "--dport", "80", "-j", tb.svcChain(j))
	case "port":
		// Only a match changes: service i's port, its rule and target
		// otherwise the same (the rule the sync wrote for it).
		c.try(fam, "-R", "KUBE-SERVICES", fmt.Sprint(i+1), "-d", tb.clusterIP(i)+tb.prefix(), "-p", "tcp",
			"-m", "comment", "--comment", fmt.Sprintf("ns/s%d:http cluster IP", i), "-m", "tcp", "--dport", "81", "-j", tb.svcChain(i))
	case "delete-dispatch":
		c.try(fam, "-D", "KUBE-SERVICES", "1")
	case "flush-chain":
		c.ipt(fam, "-F", tb.svcChain(i))
	case "noise":
		if fam == 4 {
			c.ipt(4, "-A", "CNI-OTHER", "-d", "198.18.1.1/32", "-j", "RETURN")
		}
	case "flush-table":
		c.ipt(fam, "-F")
	case "delete-chain":
		// A stale endpoint chain nothing jumps to any more.
		c.ipt(fam, "-N", "KUBE-SEP-ZZZZZZZZZZZZZZZZ")
		c.ipt(fam, "-A", "KUBE-SEP-ZZZZZZZZZZZZZZZZ", "-p", "tcp", "-j", "DNAT", "--to-destination", tb.dnatTarget(netip.MustParseAddr(map[int]string{4: "198.18.200.1", 6: "2001:2:0:9000::1"}[fam])))
		c.ipt(fam, "-F", "KUBE-SEP-ZZZZZZZZZZZZZZZZ")
		c.ipt(fam, "-X", "KUBE-SEP-ZZZZZZZZZZZZZZZZ")
	}
	return true
}

// read reads the changes and checks the model kept from them against a
// whole read (and, every tenth round, against what iptables-save prints).
func (c *iptChurn) read(round int, what string) {
	t := c.t
	t.Helper()
	c.caughtUp(round)
	var ch *audit.Changes
	var whole, text *audit.Observed
	c.inNS(func() error {
		var err error
		if ch, err = c.r.ReadChanges(c.ctx); err != nil {
			return err
		}
		// The whole read dumps the small table in one request, or
		// chain by chain every other round, as a large one.
		var wr RuleReader = iptables.NewLegacyReader(nil)
		if !c.legacy {
			nr := iptables.NewNFTReader(nil)
			if round%2 == 1 {
				nr.SetMaxDumpParts(0)
			}
			wr = nr
		}
		if whole, err = wr.Read(c.ctx); err != nil {
			return err
		}
		if round%10 == 0 {
			text, err = NewHost().iptablesSave(c.src).Read(c.ctx)
		}
		return err
	})
	if ch.Whole != nil {
		c.state = stream.FromModel(ch.Whole)
	} else {
		if c.state == nil {
			t.Fatalf("round %d: changes without a whole read first", round)
		}
		c.state = applyChanges(c.state, ch)
	}
	state, want := c.state, stream.FromModel(whole)
	var differ []string
	stream.ChangedKeys(state, want, func(k string) { differ = append(differ, k) })
	if len(differ) > 0 || state.Root() != want.Root() || state.NoRules != want.NoRules || state.Mode != want.Mode ||
		fmt.Sprint(state.Families) != fmt.Sprint(want.Families) {
		t.Fatalf("round %d (%s): the incremental model (%d frontends, root %x) is not the whole read's (%d, root %x); frontends that differ: %v",
			round, what, state.Len(), state.Root(), want.Len(), want.Root(), differ)
	}
	if text != nil {
		sameModel(t, fmt.Sprintf("round %d (%s)", round, what), whole, text)
	}
}

// caughtUp waits for the notifications of the last commit to reach the
// reader.
func (c *iptChurn) caughtUp(round int) {
	c.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for c.sig != nil {
		tok, err := c.sig.Token()
		if err != nil {
			c.t.Fatal(err)
		}
		if tok == c.tok0 || c.r.(*iptables.NFTReader).CaughtUp(tok) {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("round %d: the notifications of generation %d did not arrive in 5s", round, tok)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// summary says what the reader did, and fails when it never read
// incrementally or fell back to the text tool.
func (c *iptChurn) summary(counts map[string]int) {
	t := c.t
	if c.legacy {
		lr := c.r.(*iptables.LegacyReader)
		t.Logf("commits: %v; %d reads decoded %d chains that changed; fallbacks: %d", counts, lr.Counts().Reads, lr.Counts().Chains, fallbacks(lr))
		if fallbacks(lr) > 0 {
			t.Errorf("the reader fell back to iptables-legacy-save: %v", lastFallback(lr))
		}
		return
	}
	nr := c.r.(*iptables.NFTReader)
	t.Logf("commits: %v; chains read one by one: %d; mirrored changes applied: %d; whole reads: %d (by chain: %d); fallbacks: %d",
		counts, nr.Counts().Chains, nr.Counts().MirrorOps, nr.Counts().Whole, nr.Counts().ByChain, fallbacks(nr))
	if nr.Counts().MirrorOps == 0 {
		t.Error("no change of KUBE-SERVICES was applied from notifications")
	}
	if nr.Counts().Chains == 0 {
		t.Error("no read was incremental")
	}
	if fallbacks(nr) > 0 {
		t.Errorf("the reader fell back to iptables-save: %v", lastFallback(nr))
	}
}

func uniqueInts(xs []int) []int {
	seen := map[int]bool{}
	var out []int
	for _, x := range xs {
		if !seen[x] {
			seen[x] = true
			out = append(out, x)
		}
	}
	return out
}

// fallbacks and lastFallback: how often a reader fell back to the text
// tool, and why the last time.
func fallbacks(r interface{ Fallbacks() (uint64, string) }) uint64 {
	n, _ := r.Fallbacks()
	return n
}

func lastFallback(r interface{ Fallbacks() (uint64, string) }) string {
	_, why := r.Fallbacks()
	return why
}
