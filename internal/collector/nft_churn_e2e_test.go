package collector

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/nftables"
	"github.com/proxyaudit/proxyaudit/dataplane/nl"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// nftChurn is a kube-proxy-shaped nftables table in one family that the
// test changes at random with `nft -f` scripts.
type nftChurn struct {
	fam      int
	services int
	rng      *rand.Rand
	serial   int
}

func (c *nftChurn) family() string { return nl.FamilyName(c.fam) }

func (c *nftChurn) vip(i int) string {
	if c.fam == 6 {
		return fmt.Sprintf("2001:2:0:ffff::%x", 0x100+i)
	}
	return fmt.Sprintf("198.19.1.%d", 1+i)
}

func (c *nftChurn) svc(i int) string { return fmt.Sprintf("service-%08d-ns/s%d/tcp/http", i, i) }
func (c *nftChurn) ext(i int) string { return fmt.Sprintf("external-%08d-ns/s%d/tcp/http", i, i) }
func (c *nftChurn) loc(i int) string { return fmt.Sprintf("local-%08d-ns/s%d/tcp/http", i, i) }
func (c *nftChurn) ep(i, j int) string {
	return fmt.Sprintf("endpoint-%08d-ns/s%d/tcp/http__%d", i, i, j)
}

// endpoint is a new endpoint address:port as nft writes a DNAT's.
func (c *nftChurn) endpoint() (addr string, port int) {
	c.serial++
	if c.fam == 6 {
		return fmt.Sprintf("2001:2:0:8000::%x", c.serial), 8080
	}
	return fmt.Sprintf("198.18.%d.%d", 128+c.serial/250%100, 1+c.serial%250), 8080
}

func (c *nftChurn) addrType() string {
	if c.fam == 6 {
		return "ipv6_addr"
	}
	return "ipv4_addr"
}

// base is the table: its maps, the dispatch chains, every service.
func (c *nftChurn) base() string {
	f := c.family()
	var b strings.Builder
	fmt.Fprintf(&b, "add table %s kube-proxy\n", f)
	fmt.Fprintf(&b, "add map %s kube-proxy service-ips { type %s . inet_proto . inet_service : verdict ; }\n", f, c.addrType())
	fmt.Fprintf(&b, "add map %s kube-proxy service-nodeports { type inet_proto . inet_service : verdict ; }\n", f)
	fmt.Fprintf(&b, "add map %s kube-proxy no-endpoint-services { type %s . inet_proto . inet_service : verdict ; }\n", f, c.addrType())
	for _, ch := range []string{"services", "nodeports", "mark-for-masquerade", "reject-chain"} {
		fmt.Fprintf(&b, "add chain %s kube-proxy %s\n", f, ch)
	}
	fmt.Fprintf(&b, "add rule %s kube-proxy services %s daddr . meta l4proto . th dport vmap @service-ips\n", f, f)
	fmt.Fprintf(&b, "add rule %s kube-proxy nodeports meta l4proto . th dport vmap @service-nodeports\n", f)
	fmt.Fprintf(&b, "add rule %s kube-proxy mark-for-masquerade meta mark set meta mark or 0x4000\n", f)
	for i := range c.services {
		b.WriteString(c.rewrite(i))
		fmt.Fprintf(&b, "add element %s kube-proxy service-ips { %s . tcp . 80 : goto %s }\n", f, c.vip(i), c.svc(i))
		if i%3 == 0 {
			fmt.Fprintf(&b, "add chain %s kube-proxy %s\n", f, c.ext(i))
			fmt.Fprintf(&b, "add rule %s kube-proxy %s jump mark-for-masquerade\n", f, c.ext(i))
			fmt.Fprintf(&b, "add rule %s kube-proxy %s goto %s\n", f, c.ext(i), c.svc(i))
			fmt.Fprintf(&b, "add element %s kube-proxy service-nodeports { tcp . %d : goto %s }\n", f, 30000+i, c.ext(i))
		}
	}
	return b.String()
}

// rewrite is kube-proxy's sync of service i: its chain flushed and written
// again with new endpoints (a numgen DNAT map; for every fifth service,
// session affinity's endpoint chains).
func (c *nftChurn) rewrite(i int) string {
	f := c.family()
	var b strings.Builder
	fmt.Fprintf(&b, "add chain %s kube-proxy %s\nflush chain %s kube-proxy %s\n", f, c.svc(i), f, c.svc(i))
	n := 1 + c.rng.IntN(3)
	if i%5 == 0 {
		var vmap []string
		for j := range n {
			addr, port := c.endpoint()
			fmt.Fprintf(&b, "add chain %s kube-proxy %s\nflush chain %s kube-proxy %s\n", f, c.ep(i, j), f, c.ep(i, j))
			fmt.Fprintf(&b, "add rule %s kube-proxy %s meta l4proto tcp dnat %s to %s\n", f, c.ep(i, j), f, hostPort(c.fam, addr, port))
			vmap = append(vmap, fmt.Sprintf("%d : goto %s", j, c.ep(i, j)))
		}
		fmt.Fprintf(&b, "add rule %s kube-proxy %s numgen random mod %d vmap { %s }\n", f, c.svc(i), n, strings.Join(vmap, ", "))
		return b.String()
	}
	var m []string
	for j := range n {
		addr, port := c.endpoint()
		m = append(m, fmt.Sprintf("%d : %s . %d", j, addr, port))
	}
	fmt.Fprintf(&b, "add rule %s kube-proxy %s meta l4proto tcp dnat %s addr . port to numgen random mod %d map { %s }\n", f, c.svc(i), f, n, strings.Join(m, ", "))
	return b.String()
}

func hostPort(fam int, addr string, port int) string {
	if fam == 6 {
		return fmt.Sprintf("[%s]:%d", addr, port)
	}
	return fmt.Sprintf("%s:%d", addr, port)
}

// TestE2ENFTablesIncrementalEqualsWholeRead drives a real kernel through
// random commits of every kind nftables mode meets (kube-proxy's syncs of
// services, with and without affinity; map elements added, deleted and
// pointed elsewhere; an external chain redirected to a local one; a DNAT
// rewritten by hand; chains flushed and deleted; the whole table flushed;
// another table's changes; both families) and checks after each round
// that the model kept from notifications, with only the reported changes
// applied, is the model of a whole read.
func TestE2ENFTablesIncrementalEqualsWholeRead(t *testing.T) {
	localcluster.NeedRoot(t, false)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	ns, err := localcluster.NewScratch(ctx, "nftchurn")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	rng := rand.New(rand.NewPCG(13, 17))
	tables := map[int]*nftChurn{4: {fam: 4, services: 40, rng: rng}, 6: {fam: 6, services: 12, rng: rng}}
	apply := func(script string) {
		t.Helper()
		cmd := ns.Command(ctx, "nft", "-f", "-")
		cmd.Stdin = strings.NewReader(script)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("nft: %v: %s\n%s", err, out, script)
		}
	}
	for _, tb := range tables {
		apply(tb.base())
	}
	apply("add table ip other\nadd chain ip other c\n")
	src := Source{Mode: audit.ModeNFTables}
	var r *nftables.NetlinkReader
	var sig *nl.GenSignal
	inNS := func(f func() error) {
		t.Helper()
		if err := localcluster.InNetNS(ns.NetNS, f); err != nil {
			t.Fatal(err)
		}
	}
	inNS(func() error {
		s, err := nl.OpenGenSignal(DefaultNotifyBuffer)
		if err != nil {
			return err
		}
		sig = s
		r = NewHost().Reader(src).(*nftables.NetlinkReader)
		sig.Feed(r)
		return nil
	})
	defer sig.Close()
	tok0, err := sig.Token()
	if err != nil {
		t.Fatal(err)
	}
	ir := &nftIncremental{t: t, ctx: ctx, ns: ns, r: r, sig: sig, tok0: tok0}
	read := ir.read
	read(0, "first read")
	counts := map[string]int{}
	flushed := map[int]bool{}
	for round := 1; round <= 200; round++ {
		var did []string
		for fam, tb := range tables {
			if flushed[fam] {
				// kube-proxy restarted: its table made again.
				apply(fmt.Sprintf("delete table %s kube-proxy\n", tb.family()) + tb.base())
				did, flushed[fam] = append(did, fmt.Sprintf("restart/%d", fam)), false
			}
		}
		for range 1 + rng.IntN(3) {
			fam := 4
			if rng.IntN(5) == 0 {
				fam = 6
			}
			tb := tables[fam]
			i := rng.IntN(tb.services)
			kinds := []string{"sync", "sync", "sync", "element", "unlist", "redirect", "external", "tamper", "flush-chain", "noise", "flush-table"}
			kind := kinds[rng.IntN(len(kinds))]
			script, ok := tb.commit(ctx, ns, kind, i)
			if !ok {
				continue
			}
			if kind == "flush-table" {
				flushed[fam] = true // the next round restarts kube-proxy
			}
			apply(script)
			did = append(did, fmt.Sprintf("%s/%d", kind, fam))
			counts[kind]++
		}
		if round == 100 {
			r.Lost() // as after an overrun
			did = append(did, "lost")
		}
		read(round, strings.Join(did, " "))
	}
	t.Logf("commits: %v; whole reads %d, chains read one by one %d, maps from notifications %d, dumped %d",
		counts, r.Counts().Whole, r.Counts().Chains, r.Counts().NotedMaps, r.Counts().DumpedMaps)
	if r.Counts().Chains == 0 {
		t.Error("no read was incremental")
	}
}

// nftIncremental is the reader under test in
// TestE2ENFTablesIncrementalEqualsWholeRead and the model kept from its
// changes alone.
type nftIncremental struct {
	t     *testing.T
	ctx   context.Context
	ns    *localcluster.Scratch
	r     *nftables.NetlinkReader
	sig   *nl.GenSignal
	tok0  uint64
	state *stream.State
}

// read waits for the last commit's notifications to reach the reader,
// reads the changes and checks the model kept from them against a whole
// read.
func (ir *nftIncremental) read(round int, what string) {
	t := ir.t
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		tok, err := ir.sig.Token()
		if err != nil {
			t.Fatal(err)
		}
		if tok == ir.tok0 || ir.r.CaughtUp(tok) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("round %d: the notifications of generation %d did not arrive in 5s", round, tok)
		}
	}
	var ch *audit.Changes
	var whole *audit.Observed
	if err := localcluster.InNetNS(ir.ns.NetNS, func() error {
		var err error
		if ch, err = ir.r.ReadChanges(ir.ctx); err != nil {
			return err
		}
		whole, err = nftables.NewNetlinkReader().Read(ir.ctx)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if ch.Whole != nil {
		ir.state = stream.FromModel(ch.Whole)
	} else {
		ir.state = applyChanges(ir.state, ch)
	}
	state, want := ir.state, stream.FromModel(whole)
	var differ []string
	stream.ChangedKeys(state, want, func(k string) { differ = append(differ, k) })
	if len(differ) > 0 || state.Root() != want.Root() || state.NoRules != want.NoRules || fmt.Sprint(state.Families) != fmt.Sprint(want.Families) {
		t.Fatalf("round %d (%s): the incremental model (%d frontends, root %x) is not the whole read's (%d, root %x); frontends that differ: %v",
			round, what, state.Len(), state.Root(), want.Len(), want.Root(), differ)
	}
}

// commit returns the nft script of one random commit of the kind, about
// service i; false when there is nothing to do this time.
func (tb *nftChurn) commit(ctx context.Context, ns *localcluster.Scratch, kind string, i int) (string, bool) {
	rng, f := tb.rng, tb.family()
	var script string
	switch kind {
	case "sync":
		for range 1 + rng.IntN(5) {
			script += tb.rewrite(rng.IntN(tb.services))
		}
	case "element": // listed again after an unlist
		if strings.Contains(mustNFT(ns, ctx, "list", "map", f, "kube-proxy", "service-ips"), tb.vip(i)+" . tcp . 80") {
			return "", false
		}
		script = fmt.Sprintf("add element %s kube-proxy service-ips { %s . tcp . 80 : goto %s }\n", f, tb.vip(i), tb.svc(i))
	case "unlist":
		script = fmt.Sprintf("delete element %s kube-proxy service-ips { %s . tcp . 80 }\nadd element %s kube-proxy no-endpoint-services { %s . tcp . 80 : goto reject-chain }\n",
			f, tb.vip(i), f, tb.vip(i))
		// Fails when not listed: then do nothing this time.
		if !strings.Contains(mustNFT(ns, ctx, "list", "map", f, "kube-proxy", "service-ips"), tb.vip(i)+" . tcp . 80") {
			return "", false
		}
	case "redirect": // another service's chain
		j := rng.IntN(tb.services)
		script = fmt.Sprintf("delete element %s kube-proxy service-ips { %s . tcp . 80 }\nadd element %s kube-proxy service-ips { %s . tcp . 80 : goto %s }\n",
			f, tb.vip(i), f, tb.vip(i), tb.svc(j))
		if !strings.Contains(mustNFT(ns, ctx, "list", "map", f, "kube-proxy", "service-ips"), tb.vip(i)+" . tcp . 80") {
			script = script[strings.Index(script, "\n")+1:]
		}
	case "external": // externalTrafficPolicy: Local, and back
		i -= i % 3
		target := tb.svc(i)
		if rng.IntN(2) == 0 {
			target = tb.loc(i)
			addr, port := tb.endpoint()
			script = fmt.Sprintf("add chain %s kube-proxy %s\nflush chain %s kube-proxy %s\nadd rule %s kube-proxy %s meta l4proto tcp dnat %s to %s\n",
				f, target, f, target, f, target, f, hostPort(tb.fam, addr, port))
		}
		script += fmt.Sprintf("flush chain %s kube-proxy %s\nadd rule %s kube-proxy %s jump mark-for-masquerade\nadd rule %s kube-proxy %s goto %s\n",
			f, tb.ext(i), f, tb.ext(i), f, tb.ext(i), target)
	case "tamper": // one DNAT rewritten by hand
		addr, port := tb.endpoint()
		chain := tb.svc(i)
		if i%5 == 0 {
			chain = tb.ep(i, 0)
		}
		script = fmt.Sprintf("flush chain %s kube-proxy %s\nadd rule %s kube-proxy %s meta l4proto tcp dnat %s to %s\n", f, chain, f, chain, f, hostPort(tb.fam, addr, port))
	case "flush-chain":
		script = fmt.Sprintf("flush chain %s kube-proxy %s\n", f, tb.svc(i))
	case "noise":
		script = "add rule ip other c counter\n"
	case "flush-table":
		// Every chain emptied (the maps keep their elements).
		script = fmt.Sprintf("flush table %s kube-proxy\n", f)
	}
	return script, true
}

func mustNFT(ns *localcluster.Scratch, ctx context.Context, args ...string) string {
	out, _ := ns.Exec(ctx, append([]string{"nft"}, args...)...)
	return out
}
