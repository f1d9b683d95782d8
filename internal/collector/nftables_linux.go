package collector

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/nftables"
)

// nftNetlinkReader reads kube-proxy's nftables table (table ip
// kube-proxy) straight from the kernel over netlink, without running nft:
// one dump of the table's rules, one dump of each map the audit reads
// (service-ips, service-nodeports, no-endpoint-services) and one of each
// anonymous map a service's rules look up (numgen DNAT and verdict maps).
// Only the expressions the model needs are decoded. `nft list ruleset`
// takes seconds with large sets; this reads the anchors (10k services,
// 100k endpoints) in a fraction of that (docs/benchmarks.md).
type nftNetlinkReader struct {
	mu    sync.Mutex
	conn  *netlink.Conn
	buf   []byte // a dump's datagram (receiveDump)
	bytes atomic.Int64
	// anon caches the elements of anonymous maps by name and handle. An
	// anonymous set bound to a rule never changes (kube-proxy replaces the
	// rule and its map), and set handles are never reused within a
	// table, so a map seen before need not be dumped again: the kernel
	// finds a set by name with a walk of the table's sets, so dumping
	// every one of 10k maps costs seconds of system time, and a read
	// under churn dumps only the maps created since the last.
	// One cache per family (index 4, 6): each table numbers its own sets.
	anon [7]map[string]cachedSet
	// tableHandle is the handle of the table the cache is of: a table
	// deleted and created again numbers its sets from 1 again.
	tableHandle [7]uint64
	// notes are the maps the change signal's notifications announced
	// since (see mapNotes); noted and dumped count where the maps of the
	// reads came from.
	notes         mapNotes
	noted, dumped atomic.Int64
	// touched is what the notifications say each commit touched; fams
	// what the reader keeps of each family's table between reads (nil:
	// the next read is whole).
	touched nftTouched
	fams    [2]*nftFam
	// omitChains: the models built leave out endpoint chain names (set
	// by ReadChanges, whose results are streamed).
	omitChains bool
	// whole and chains count whole reads and chains read one by one;
	// interrupted counts dumps a commit interrupted (asked again), and
	// byChain whole reads made chain by chain after that.
	whole, chains, interrupted, byChain atomic.Int64
	// peeks spaces the dumps Flushed makes when notifications were lost.
	peeks peekRate
}

// nftFam is what the reader keeps of one family's table: the model, the
// table's sets (name to handle, kept from notifications) and its maps.
type nftFam struct {
	kube       *nftables.Kube
	sets       map[string]setInfo
	dispatches bool
	// services is how many rules the services chain (the dispatch) holds.
	services   int
	serviceIPs []nftables.MapEntry
	nodePorts  []nftables.MapEntry
	noEndpoint []audit.FrontendKey
}

// Note, Lost and Subscribed make the reader a NotificationSink of the
// change signal.
func (r *nftNetlinkReader) Note(typ, flags uint16, data []byte) {
	r.notes.Note(typ, flags, data)
	r.touched.Note(typ, flags, data)
}

// Lost: see NotificationSink.
func (r *nftNetlinkReader) Lost() {
	r.notes.Lost()
	r.touched.Lost()
}

// Subscribed: see NotificationSink.
func (r *nftNetlinkReader) Subscribed(on bool) { r.touched.Subscribed(on) }

type cachedSet struct {
	handle uint64
	m      *lookupMap
}

// lookupMap is a map a rule looks up, decoded: the verdict targets of a
// verdict map, or the addresses of a DNAT map.
type lookupMap struct {
	targets []string
	dnat    []netip.AddrPort
}

func decodeLookupMap(family int, els []nftElem) *lookupMap {
	m := &lookupMap{}
	for _, el := range els {
		if el.target != "" {
			m.targets = append(m.targets, el.target)
		}
		if ap, ok := dnatValue(family, el.data); ok {
			m.dnat = append(m.dnat, ap)
		}
	}
	return m
}

var _ RuleReader = (*nftNetlinkReader)(nil)

func (r *nftNetlinkReader) String() string { return "nftables (netlink)" }

// Source is where the reader reads from.
func (r *nftNetlinkReader) Source() Source { return Source{Mode: audit.ModeNFTables} }

// BytesRead is what the last read received from the kernel.
func (r *nftNetlinkReader) BytesRead() int64 { return r.bytes.Load() }

// NoEndpoints implements NoEndpointReader: the no-endpoint-services and
// no-endpoint-nodeports maps' frontends, both families, as last read.
func (r *nftNetlinkReader) NoEndpoints() []audit.FrontendKey {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []audit.FrontendKey
	for _, f := range r.fams {
		if f != nil {
			out = append(out, f.noEndpoint...)
		}
	}
	return out
}

// kubeProxyTable is the table kube-proxy's nftables mode programs.
const kubeProxyTable = "kube-proxy"

// nftMaps are the named maps the audit reads.
var nftNamedMaps = []string{"service-ips", "service-nodeports", "no-endpoint-services", "no-endpoint-nodeports"}

var _ ChangeReader = (*nftNetlinkReader)(nil)

// Read reads both families' tables whole.
func (r *nftNetlinkReader) Read(ctx context.Context) (*audit.Observed, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fams, r.omitChains = [2]*nftFam{}, false
	ch, err := r.read(ctx)
	if err != nil {
		return nil, err
	}
	return ch.Whole, nil
}

// ReadChanges reads what changed since the last read: the chains the
// notifications named, each dumped on its own, and the named maps when
// their elements changed.
func (r *nftNetlinkReader) ReadChanges(ctx context.Context) (*Changes, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.omitChains = true
	return r.read(ctx)
}

func (r *nftNetlinkReader) read(ctx context.Context) (*Changes, error) {
	if r.conn == nil {
		c, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
		if err != nil {
			return nil, fmt.Errorf("open nf_tables netlink: %w", err)
		}
		r.conn = c
	}
	// Both families' tables: kube-proxy keeps one per family, both even
	// on a single-stack node where the kernel has IPv6.
	var n int64
	defer func() { r.bytes.Store(n) }()
	lost, through, touched := r.touched.take()
	whole := false
	var changed []audit.ObservedFrontend
	var removed []audit.FrontendKey
	for i, fam := range []int{4, 6} {
		f, t := r.fams[i], touched[i]
		var err error
		if f == nil || lost || t.reset {
			f, err = r.wholeFamily(ctx, fam, &n)
			whole = true
		} else {
			err = r.update(ctx, fam, f, t, &n)
		}
		if err != nil {
			// A broken socket is reopened on the next read.
			r.conn.Close()
			r.conn, r.fams = nil, [2]*nftFam{}
			return nil, fmt.Errorf("read table %s %s over netlink: %w", nftFamily(fam), kubeProxyTable, err)
		}
		r.fams[i] = f
		f.kube.OmitEndpointChains = r.omitChains
		c, rm := f.kube.Changes()
		changed, removed = append(changed, c...), append(removed, rm...)
	}
	if whole {
		parts := make([]*audit.Observed, 2)
		for i, f := range r.fams {
			o, err := f.kube.Observed()
			if err != nil {
				r.fams = [2]*nftFam{}
				return nil, err
			}
			parts[i] = o
		}
		obs, err := audit.Merge(parts...)
		if err != nil {
			r.fams = [2]*nftFam{}
			return nil, err
		}
		r.rebase()
		return &Changes{Whole: obs}, nil
	}
	r.rebase()
	slices.SortFunc(changed, func(a, b audit.ObservedFrontend) int { return a.FrontendKey.Compare(b.FrontendKey) })
	slices.SortFunc(removed, audit.FrontendKey.Compare)
	return &Changes{Through: through, Frontends: changed, Removed: removed, Families: []int{4, 6}, Mode: audit.ModeNFTables,
		NoRules: r.fams[0].kube.Len()+r.fams[1].kube.Len() == 0}, nil
}

// rebase tells the notes how many rules each family's services chain
// holds as read (see flushWatch).
func (r *nftNetlinkReader) rebase() {
	for i, f := range r.fams {
		r.touched.rebase(i, f.services)
	}
}

// Flushed: a commit since the last read emptied the services chain (or
// cut it to half) in a family that had services, or deleted kube-proxy's
// table; or, when notifications were lost since, the services chain
// holds no rule now.
func (r *nftNetlinkReader) Flushed(ctx context.Context) bool {
	tripped, incomplete := r.touched.flushed()
	if tripped || !incomplete {
		return tripped
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.conn == nil || !r.peeks.allow(time.Now()) {
		return false
	}
	for i, fam := range []int{4, 6} {
		if r.fams[i] == nil || r.fams[i].kube.Len() == 0 {
			continue
		}
		// Dumped whole on the reader's socket (a few rules; see
		// iptNFTReader.dispatchEmpty for why not a peek).
		rules := 0
		var n int64
		err := r.dump(ctx, unix.NFT_MSG_GETRULE, nfproto(fam), []netlink.Attribute{{Type: unix.NFTA_RULE_TABLE, Data: cstring(kubeProxyTable)},
			{Type: unix.NFTA_RULE_CHAIN, Data: cstring("services")}}, &n, func([]byte) error { rules++; return nil })
		if (err == nil || errors.Is(err, unix.ENOENT)) && rules == 0 {
			return true
		}
	}
	return false
}

// wholeFamily reads a family's table whole into what the reader keeps of
// it. A table that is gone reads as an empty one: kube-proxy's rules of
// this family were removed (or the kernel has no IPv6: then no service of
// the family can exist either).
func (r *nftNetlinkReader) wholeFamily(ctx context.Context, fam int, n *int64) (*nftFam, error) {
	r.whole.Add(1)
	t, sets, err := r.table(ctx, fam, n)
	if errors.Is(err, unix.ENOENT) {
		t, sets, err = &nftables.Table{Family: fam}, map[string]setInfo{}, nil
	}
	if err != nil {
		return nil, err
	}
	f := &nftFam{kube: nftables.NewKube(fam), sets: sets, dispatches: t.Dispatches, services: len(t.Chains["services"]),
		serviceIPs: t.ServiceIPs, nodePorts: t.NodePorts, noEndpoint: t.NoEndpoints}
	f.kube.SetMaps(t.Dispatches, t.ServiceIPs, t.NodePorts, t.NoEndpoints)
	for chain, rules := range t.Chains {
		if frontendChain(chain) { // the only chains the model reads
			f.kube.SetChain(chain, rules)
		}
	}
	return f, nil
}

// update reads what the notifications say changed in a family's table.
func (r *nftNetlinkReader) update(ctx context.Context, family int, f *nftFam, t nftFamTouched, n *int64) error {
	fam := byte(unix.NFPROTO_IPV4)
	if family == 6 {
		fam = unix.NFPROTO_IPV6
	}
	cache := r.anon[family]
	if cache == nil {
		cache = map[string]cachedSet{}
		r.anon[family] = cache
	}
	for _, sc := range t.sets {
		if sc.gone {
			delete(f.sets, sc.name)
			delete(cache, sc.name)
		} else {
			f.sets[sc.name] = sc.info
		}
	}
	mapsChanged := t.maps
	looked := map[string]*lookupMap{}
	for chain := range t.chains {
		if !frontendChain(chain) && chain != "services" {
			continue
		}
		rules, err := r.chainRules(ctx, fam, chain, n)
		if err != nil {
			return err
		}
		if chain == "services" {
			f.services = len(rules)
			if d := dispatchesOf(rules); d != f.dispatches {
				f.dispatches, mapsChanged = d, true
			}
			continue
		}
		if err := r.lookups(ctx, fam, family, chain, rules, f.sets, nil, cache, cache, looked, n); err != nil {
			return err
		}
		stmts := make([][]nftables.Statement, len(rules))
		for i, rule := range rules {
			for _, st := range rule.stmts {
				stmts[i] = append(stmts[i], statement(st, looked))
			}
		}
		f.kube.SetChain(chain, stmts)
	}
	if mapsChanged {
		maps, err := r.namedMaps(ctx, fam, n)
		if err != nil {
			return err
		}
		if f.serviceIPs, f.nodePorts, f.noEndpoint, err = mapEntries(family, maps); err != nil {
			return err
		}
		f.kube.SetMaps(f.dispatches, f.serviceIPs, f.nodePorts, f.noEndpoint)
	}
	// Maps announced but gone again (or never looked up) are forgotten.
	var last uint64
	for _, info := range f.sets {
		last = max(last, info.handle)
	}
	r.notes.seen(fam, last)
	return nil
}

// chainRules dumps one chain's rules (none: the chain is gone).
func (r *nftNetlinkReader) chainRules(ctx context.Context, fam byte, chain string, n *int64) ([]nftRule, error) {
	r.chains.Add(1)
	var rules []nftRule
	err := r.dump(ctx, unix.NFT_MSG_GETRULE, fam, []netlink.Attribute{{Type: unix.NFTA_RULE_TABLE, Data: cstring(kubeProxyTable)},
		{Type: unix.NFTA_RULE_CHAIN, Data: cstring(chain)}}, n, func(data []byte) error {
		rule, err := decodeRule(data)
		if err == nil && rule.chain == chain {
			rules = append(rules, rule)
		}
		return err
	})
	if errors.Is(err, unix.ENOENT) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("chain %s: %w", clip(chain), err)
	}
	return rules, nil
}

// rulesByChain reads the table's rules chain by chain, for a whole read
// whose one dump commits kept interrupting: the chains the audit reads
// (frontends' and the services dispatch), named by the chain list. A
// chain list can be interrupted too (a chain made or deleted between its
// parts); the names of every try are taken, so a chain one try skipped
// is named by another, and one made since is named by the notifications
// for the next read.
func (r *nftNetlinkReader) rulesByChain(ctx context.Context, fam byte, n *int64) (map[string][]nftRule, error) {
	r.byChain.Add(1)
	names := map[string]struct{}{}
	list := func(data []byte) error {
		if table, chain := chainOf(data); table == kubeProxyTable && (chain == "services" || frontendChain(chain)) {
			names[chain] = struct{}{}
		}
		return nil
	}
	for try := 0; ; try++ {
		err := r.dumpTries(ctx, 1, true, unix.NFT_MSG_GETCHAIN, fam, []netlink.Attribute{{Type: unix.NFTA_CHAIN_TABLE, Data: cstring(kubeProxyTable)}}, n, list)
		if err == nil || try+1 == interruptedTries && errors.Is(err, errDumpInterrupted) {
			break
		}
		if !errors.Is(err, errDumpInterrupted) {
			return nil, err
		}
	}
	rules := make(map[string][]nftRule, len(names))
	for chain := range names {
		rs, err := r.chainRules(ctx, fam, chain, n)
		if err != nil {
			return nil, err
		}
		if rs != nil {
			rules[chain] = rs
		}
	}
	return rules, nil
}

// dispatchesOf says whether the services chain looks up service-ips.
func dispatchesOf(rules []nftRule) bool {
	for _, rule := range rules {
		for _, st := range rule.stmts {
			if st.vmap && st.set == "service-ips" {
				return true
			}
		}
	}
	return false
}

// table reads kube-proxy's table of one family, and lists its sets; n
// counts the bytes read.
func (r *nftNetlinkReader) table(ctx context.Context, family int, n *int64) (*nftables.Table, map[string]setInfo, error) {
	fam := byte(unix.NFPROTO_IPV4)
	if family == 6 {
		fam = unix.NFPROTO_IPV6
	}
	// The table's handle first: a table deleted and created again during
	// the read numbers its sets anew, and the cache must not serve them.
	handle, err := r.handleOfTable(ctx, fam)
	if err != nil {
		return nil, nil, err
	}
	rules := map[string][]nftRule{}
	// Under churn a large table's dump outlasts the gap between two
	// commits: tried twice, then read chain by chain (each chain's dump
	// is one or two parts, rarely interrupted).
	err = r.dumpTries(ctx, 2, false, unix.NFT_MSG_GETRULE, fam, []netlink.Attribute{{Type: unix.NFTA_RULE_TABLE, Data: cstring(kubeProxyTable)}}, n,
		func(data []byte) error {
			rule, err := decodeRule(data)
			if err != nil {
				return err
			}
			rules[rule.chain] = append(rules[rule.chain], rule)
			return nil
		})
	if errors.Is(err, errDumpInterrupted) {
		rules, err = r.rulesByChain(ctx, fam, n)
	}
	if err != nil {
		return nil, nil, err
	}
	t := &nftables.Table{Family: family, Chains: make(map[string][][]nftables.Statement, len(rules))}
	sets, err := r.sets(ctx, fam, n)
	if err != nil {
		return nil, nil, err
	}
	maps, err := r.namedMaps(ctx, fam, n)
	if err != nil {
		return nil, nil, err
	}
	// The maps the frontends' chains look up (anonymous: a numgen DNAT or
	// verdict map per service); those of the last read still in the table
	// come from the cache.
	if r.anon[family] == nil || handle != r.tableHandle[family] {
		r.anon[family], r.tableHandle[family] = map[string]cachedSet{}, handle
	}
	cache := r.anon[family]
	fresh := make(map[string]cachedSet, len(cache))
	defer func() { r.anon[family] = fresh }()
	looked := map[string]*lookupMap{}
	for chain, rs := range rules {
		if frontendChain(chain) {
			if err := r.lookups(ctx, fam, family, chain, rs, sets, maps, cache, fresh, looked, n); err != nil {
				return nil, nil, err
			}
		}
	}
	// Maps announced but gone again (or never looked up) are forgotten.
	var last uint64
	for _, info := range sets {
		last = max(last, info.handle)
	}
	r.notes.seen(fam, last)
	for chain, rs := range rules {
		out := make([][]nftables.Statement, len(rs))
		for i, rule := range rs {
			for _, st := range rule.stmts {
				out[i] = append(out[i], statement(st, looked))
			}
		}
		t.Chains[chain] = out
	}
	t.Dispatches = dispatchesOf(rules["services"])
	if t.ServiceIPs, t.NodePorts, t.NoEndpoints, err = mapEntries(family, maps); err != nil {
		return nil, nil, err
	}
	return t, sets, nil
}

// lookups resolves the maps a chain's rules look up into looked: a named
// map read with the table (named), or an anonymous one from the cache
// (by name and handle), from the notifications, or dumped; the anonymous
// ones go into fresh.
func (r *nftNetlinkReader) lookups(ctx context.Context, fam byte, family int, chain string, rs []nftRule, sets map[string]setInfo,
	named map[string][]nftElem, cache, fresh map[string]cachedSet, looked map[string]*lookupMap, n *int64) error {
	for _, rule := range rs {
		for _, st := range rule.stmts {
			if !(st.vmap || st.dnatMap) || st.set == "" || looked[st.set] != nil {
				continue
			}
			if els, ok := named[st.set]; ok {
				looked[st.set] = decodeLookupMap(family, els)
				continue
			}
			info, known := sets[st.set]
			if c, ok := cache[st.set]; ok && known && info.anonymous && c.handle == info.handle {
				looked[st.set], fresh[st.set] = c.m, c
				continue
			}
			var m *lookupMap
			ok := false
			if known && info.anonymous {
				m, ok = r.notes.take(fam, info.handle)
			}
			if ok {
				r.noted.Add(1)
			} else {
				els, err := r.elements(ctx, fam, st.set, n)
				if err != nil {
					return fmt.Errorf("map %s of chain %s: %w", st.set, chain, err)
				}
				r.dumped.Add(1)
				m = decodeLookupMap(family, els)
			}
			looked[st.set] = m
			if known && info.anonymous {
				fresh[st.set] = cachedSet{handle: info.handle, m: m}
			}
		}
	}
	return nil
}

// namedMaps dumps the named maps the audit reads (a map that is not there
// reads as empty).
func (r *nftNetlinkReader) namedMaps(ctx context.Context, fam byte, n *int64) (map[string][]nftElem, error) {
	maps := map[string][]nftElem{}
	for _, name := range nftNamedMaps {
		els, err := r.elements(ctx, fam, name, n)
		if err != nil && !errors.Is(err, unix.ENOENT) {
			return nil, fmt.Errorf("map %s: %w", name, err)
		}
		maps[name] = els
	}
	return maps, nil
}

// mapEntries decodes the named maps' elements.
func mapEntries(family int, maps map[string][]nftElem) (ips, ports []nftables.MapEntry, none []audit.FrontendKey, err error) {
	for _, el := range maps["service-ips"] {
		k, err := serviceIPKey(family, el.key)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("map service-ips: %w", err)
		}
		ips = append(ips, nftables.MapEntry{Key: k, Target: el.target})
	}
	for _, el := range maps["service-nodeports"] {
		k, err := nodePortKey(family, el.key)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("map service-nodeports: %w", err)
		}
		ports = append(ports, nftables.MapEntry{Key: k, Target: el.target})
	}
	for _, el := range maps["no-endpoint-services"] {
		if k, err := serviceIPKey(family, el.key); err == nil {
			none = append(none, k)
		}
	}
	// A node port with no endpoints: its UDP flows stay pinned to the gone
	// pods even where kube-proxy cleans a service's (1.37 skips node
	// ports without endpoints: pkg/proxy/conntrack/cleanup.go).
	for _, el := range maps["no-endpoint-nodeports"] {
		if k, err := nodePortKey(family, el.key); err == nil {
			none = append(none, k)
		}
	}
	return ips, ports, none, nil
}

// frontendChain: the chains a frontend's traffic goes through.
func frontendChain(chain string) bool {
	for _, p := range []string{"service-", "external-", "local-", "endpoint-"} {
		if strings.HasPrefix(chain, p) {
			return true
		}
	}
	return false
}

// statement turns a decoded statement into the audit's, its maps resolved.
func statement(st nftStmt, looked map[string]*lookupMap) nftables.Statement {
	var out nftables.Statement
	switch {
	case st.target != "":
		out.Gotos, out.Verdict = []string{st.target}, true
	case st.vmap && looked[st.set] != nil:
		out.Gotos = looked[st.set].targets
	case st.dnatMap && looked[st.set] != nil:
		out.DNAT = looked[st.set].dnat
	case st.dnat.IsValid():
		out.DNAT = []netip.AddrPort{st.dnat}
	}
	return out
}

// sets lists the table's sets with their handles.
func (r *nftNetlinkReader) sets(ctx context.Context, fam byte, n *int64) (map[string]setInfo, error) {
	out := map[string]setInfo{}
	err := r.dump(ctx, unix.NFT_MSG_GETSET, fam, []netlink.Attribute{{Type: unix.NFTA_SET_TABLE, Data: cstring(kubeProxyTable)}}, n,
		func(data []byte) error {
			name, info, err := decodeSet(data)
			if err != nil {
				return err
			}
			out[name] = info
			return nil
		})
	return out, err
}

// handleOfTable is the handle of kube-proxy's table (ENOENT: no table).
func (r *nftNetlinkReader) handleOfTable(ctx context.Context, fam byte) (uint64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	body, err := netlink.MarshalAttributes([]netlink.Attribute{{Type: unix.NFTA_TABLE_NAME, Data: cstring(kubeProxyTable)}})
	if err != nil {
		return 0, err
	}
	msgs, err := r.conn.Execute(netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETTABLE), Flags: netlink.Request},
		Data:   append([]byte{fam, unix.NFNETLINK_V0, 0, 0}, body...),
	})
	if err != nil {
		return 0, err
	}
	for _, m := range msgs {
		if h, ok := tableHandle(m.Data); ok {
			return h, nil
		}
	}
	return 0, errors.New("no handle in the kernel's answer for the table")
}

// elements dumps one set's or map's elements.
func (r *nftNetlinkReader) elements(ctx context.Context, fam byte, set string, n *int64) ([]nftElem, error) {
	var out []nftElem
	err := r.dump(ctx, unix.NFT_MSG_GETSETELEM, fam, []netlink.Attribute{
		{Type: unix.NFTA_SET_ELEM_LIST_TABLE, Data: cstring(kubeProxyTable)},
		{Type: unix.NFTA_SET_ELEM_LIST_SET, Data: cstring(set)},
	}, n, func(data []byte) error {
		var err error
		out, err = decodeElems(data, out)
		return err
	})
	return out, err
}

// dump sends one nf_tables dump request and hands each reply's body to
// fn. A dump the kernel flags interrupted by a commit (NLM_F_DUMP_INTR:
// it resumes a dump by position, so a commit between two parts can skip
// or repeat rules of chains it never touched) is asked again, up to
// interruptedTries times, and then fails with errDumpInterrupted; fn
// sees only an answer that was not interrupted.
func (r *nftNetlinkReader) dump(ctx context.Context, msg uint16, fam byte, attrs []netlink.Attribute, n *int64, fn func([]byte) error) error {
	return r.dumpTries(ctx, interruptedTries, false, msg, fam, attrs, n, fn)
}

// errDumpInterrupted: every try of a dump was interrupted by a commit.
var errDumpInterrupted = errors.New("every try of the dump was interrupted by a commit")

// dumpTries is dump with its number of tries; with keep, fn is handed the
// interrupted answers too (before the error).
func (r *nftNetlinkReader) dumpTries(ctx context.Context, tries int, keep bool, msg uint16, fam byte, attrs []netlink.Attribute, n *int64, fn func([]byte) error) error {
	body, err := netlink.MarshalAttributes(attrs)
	if err != nil {
		return err
	}
	req := netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | msg), Flags: netlink.Request | netlink.Dump},
		Data:   append([]byte{fam, unix.NFNETLINK_V0, 0, 0}, body...),
	}
	for try := 0; try < tries; try++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		sent, err := r.conn.Send(req)
		if err != nil {
			return err
		}
		bodies, intr, err := r.receiveDump(sent.Header.Sequence, n)
		if err != nil {
			return err
		}
		if intr {
			r.interrupted.Add(1)
			if !keep {
				continue
			}
		}
		for _, b := range bodies {
			if err := fn(b); err != nil {
				return err
			}
		}
		if !intr {
			return nil
		}
	}
	return errDumpInterrupted
}

// dumpBuffer holds one datagram of a dump (the kernel's dump parts are at
// most a few pages).
const dumpBuffer = 256 << 10

// receiveDump reads the parts of dump seq up to the kernel's done message
// and returns the messages' bodies, and whether any part — the done
// message included — was flagged interrupted by a commit. The done
// message can be the only one flagged (a commit just before the dump's
// last, empty round, which resumed by position past the rules a commit
// moved: the table's last rules never came); the library's Receive drops
// it, flag and all, so the datagrams are read here (nlMessages).
func (r *nftNetlinkReader) receiveDump(seq uint32, n *int64) (bodies [][]byte, intr bool, err error) {
	rc, err := r.conn.SyscallConn()
	if err != nil {
		return nil, false, err
	}
	if r.buf == nil {
		r.buf = make([]byte, dumpBuffer)
	}
	for {
		var size int
		var rerr error
		if err := rc.Read(func(fd uintptr) bool {
			size, _, rerr = unix.Recvfrom(int(fd), r.buf, 0)
			return rerr != unix.EAGAIN && rerr != unix.EWOULDBLOCK
		}); err != nil {
			return nil, intr, err
		}
		if rerr != nil {
			return nil, intr, fmt.Errorf("receive: %w", rerr)
		}
		*n += int64(size)
		done, in, err := nlMessages(r.buf[:size], seq, func(b []byte) error {
			bodies = append(bodies, bytes.Clone(b))
			return nil
		})
		intr = intr || in
		if err != nil || done {
			return bodies, intr, err
		}
	}
}

func cstring(s string) []byte { return append([]byte(s), 0) }

func newNFTNetlinkReader() RuleReader { return &nftNetlinkReader{} }
