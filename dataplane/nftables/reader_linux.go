package nftables

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// NetlinkReader reads kube-proxy's nftables table (table ip
// kube-proxy) straight from the kernel over netlink, without running nft:
// one dump of the table's rules, one dump of each map the audit reads
// (service-ips, service-nodeports, no-endpoint-services) and one of each
// anonymous map a service's rules look up (numgen DNAT and verdict maps).
// Only the expressions the model needs are decoded. `nft list ruleset`
// takes seconds with large sets; this reads the anchors (10k services,
// 100k endpoints) in a fraction of that (docs/benchmarks.md).
type NetlinkReader struct {
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
	peeks nl.PeekRate
}

// nftFam is what the reader keeps of one family's table: the model, the
// table's sets (name to handle, kept from notifications) and its maps.
type nftFam struct {
	kube       *Kube
	sets       map[string]SetInfo
	dispatches bool
	// services is how many rules the services chain (the dispatch) holds.
	services   int
	serviceIPs []MapEntry
	nodePorts  []MapEntry
	noEndpoint []audit.FrontendKey
}

// Note, Lost and Subscribed take the nf_tables notifications the
// collector's change signal receives (its NotificationSink): what each
// commit touched, so that a read dumps only that.
func (r *NetlinkReader) Note(typ, flags uint16, data []byte) {
	r.notes.Note(typ, flags, data)
	r.touched.Note(typ, flags, data)
}

// Lost: a notification was dropped; the next read is whole.
func (r *NetlinkReader) Lost() {
	r.notes.Lost()
	r.touched.Lost()
}

// Subscribed says whether notifications flow: without them every read
// is whole.
func (r *NetlinkReader) Subscribed(on bool) { r.touched.Subscribed(on) }

type cachedSet struct {
	handle uint64
	m      *LookupMap
}

func (r *NetlinkReader) String() string { return "nftables (netlink)" }

// Mode is the mode whose rules the reader reads.
func (r *NetlinkReader) Mode() audit.Mode { return audit.ModeNFTables }

// Counts are what the reader's reads did so far: whole reads, chains
// read one by one, dumps a commit interrupted (asked again), whole reads
// made chain by chain after that, and where the maps came from (the
// notifications, or dumps).
type Counts struct {
	Whole, Chains, Interrupted, ByChain int64
	NotedMaps, DumpedMaps               int64
}

// Counts returns the reader's counts so far.
func (r *NetlinkReader) Counts() Counts {
	return Counts{Whole: r.whole.Load(), Chains: r.chains.Load(), Interrupted: r.interrupted.Load(), ByChain: r.byChain.Load(),
		NotedMaps: r.noted.Load(), DumpedMaps: r.dumped.Load()}
}

// CaughtUp says whether the notifications the reader took hold every
// change up to the commit of generation gen, or lost one on the way (see
// nl.Notes.CaughtUp).
func (r *NetlinkReader) CaughtUp(gen uint64) bool { return r.touched.CaughtUp(gen) }

// BytesRead is what the last read received from the kernel.
func (r *NetlinkReader) BytesRead() int64 { return r.bytes.Load() }

// NoEndpoints implements NoEndpointReader: the no-endpoint-services and
// no-endpoint-nodeports maps' frontends, both families, as last read.
func (r *NetlinkReader) NoEndpoints() []audit.FrontendKey {
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

// Read reads both families' tables whole.
func (r *NetlinkReader) Read(ctx context.Context) (*audit.Observed, error) {
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
func (r *NetlinkReader) ReadChanges(ctx context.Context) (*audit.Changes, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.omitChains = true
	return r.read(ctx)
}

func (r *NetlinkReader) read(ctx context.Context) (*audit.Changes, error) {
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
			return nil, fmt.Errorf("read table %s %s over netlink: %w", nl.FamilyName(fam), kubeProxyTable, err)
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
		return &audit.Changes{Whole: obs}, nil
	}
	r.rebase()
	slices.SortFunc(changed, func(a, b audit.ObservedFrontend) int { return a.FrontendKey.Compare(b.FrontendKey) })
	slices.SortFunc(removed, audit.FrontendKey.Compare)
	return &audit.Changes{Through: through, Frontends: changed, Removed: removed, Families: []int{4, 6}, Mode: audit.ModeNFTables,
		NoRules: r.fams[0].kube.Len()+r.fams[1].kube.Len() == 0}, nil
}

// rebase tells the notes how many rules each family's services chain
// holds as read (see flushWatch).
func (r *NetlinkReader) rebase() {
	for i, f := range r.fams {
		r.touched.Rebase(i, f.services)
	}
}

// Flushed: a commit since the last read emptied the services chain (or
// cut it to half) in a family that had services, or deleted kube-proxy's
// table; or, when notifications were lost since, the services chain
// holds no rule now.
func (r *NetlinkReader) Flushed(ctx context.Context) bool {
	tripped, incomplete := r.touched.Flushed()
	if tripped || !incomplete {
		return tripped
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.conn == nil || !r.peeks.Allow(time.Now()) {
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
		err := r.dump(ctx, unix.NFT_MSG_GETRULE, nl.Proto(fam), []netlink.Attribute{{Type: unix.NFTA_RULE_TABLE, Data: nl.CString(kubeProxyTable)},
			{Type: unix.NFTA_RULE_CHAIN, Data: nl.CString("services")}}, &n, func([]byte) error { rules++; return nil })
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
func (r *NetlinkReader) wholeFamily(ctx context.Context, fam int, n *int64) (*nftFam, error) {
	r.whole.Add(1)
	t, sets, err := r.table(ctx, fam, n)
	if errors.Is(err, unix.ENOENT) {
		t, sets, err = &Table{Family: fam}, map[string]SetInfo{}, nil
	}
	if err != nil {
		return nil, err
	}
	f := &nftFam{kube: NewKube(fam), sets: sets, dispatches: t.Dispatches, services: len(t.Chains["services"]),
		serviceIPs: t.ServiceIPs, nodePorts: t.NodePorts, noEndpoint: t.NoEndpoints}
	f.kube.SetMaps(t.Dispatches, t.ServiceIPs, t.NodePorts, t.NoEndpoints)
	for chain, rules := range t.Chains {
		if FrontendChain(chain) { // the only chains the model reads
			f.kube.SetChain(chain, rules)
		}
	}
	return f, nil
}

// update reads what the notifications say changed in a family's table.
func (r *NetlinkReader) update(ctx context.Context, family int, f *nftFam, t nftFamTouched, n *int64) error {
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
	looked := map[string]*LookupMap{}
	for chain := range t.chains {
		if !FrontendChain(chain) && chain != "services" {
			continue
		}
		rules, err := r.chainRules(ctx, fam, chain, n)
		if err != nil {
			return err
		}
		if chain == "services" {
			f.services = len(rules)
			if d := Dispatches(rules); d != f.dispatches {
				f.dispatches, mapsChanged = d, true
			}
			continue
		}
		if err := r.lookups(ctx, fam, family, chain, rules, f.sets, nil, cache, cache, looked, n); err != nil {
			return err
		}
		stmts := make([][]Statement, len(rules))
		for i, rule := range rules {
			for _, st := range rule.Stmts {
				stmts[i] = append(stmts[i], StatementOf(st, looked))
			}
		}
		f.kube.SetChain(chain, stmts)
	}
	if mapsChanged {
		maps, err := r.namedMaps(ctx, fam, n)
		if err != nil {
			return err
		}
		if f.serviceIPs, f.nodePorts, f.noEndpoint, err = MapEntries(family, maps); err != nil {
			return err
		}
		f.kube.SetMaps(f.dispatches, f.serviceIPs, f.nodePorts, f.noEndpoint)
	}
	// Maps announced but gone again (or never looked up) are forgotten.
	var last uint64
	for _, info := range f.sets {
		last = max(last, info.Handle)
	}
	r.notes.seen(fam, last)
	return nil
}

// table reads kube-proxy's table of one family, and lists its sets; n
// counts the bytes read.
func (r *NetlinkReader) table(ctx context.Context, family int, n *int64) (*Table, map[string]SetInfo, error) {
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
	rules := map[string][]Rule{}
	// Under churn a large table's dump outlasts the gap between two
	// commits: tried twice, then read chain by chain (each chain's dump
	// is one or two parts, rarely interrupted).
	err = r.dumpTries(ctx, 2, false, unix.NFT_MSG_GETRULE, fam, []netlink.Attribute{{Type: unix.NFTA_RULE_TABLE, Data: nl.CString(kubeProxyTable)}}, n,
		func(data []byte) error {
			rule, err := DecodeRule(data)
			if err != nil {
				return err
			}
			rules[rule.Chain] = append(rules[rule.Chain], rule)
			return nil
		})
	if errors.Is(err, nl.ErrDumpInterrupted) {
		rules, err = r.rulesByChain(ctx, fam, n)
	}
	if err != nil {
		return nil, nil, err
	}
	t := &Table{Family: family, Chains: make(map[string][][]Statement, len(rules))}
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
	looked := map[string]*LookupMap{}
	for chain, rs := range rules {
		if FrontendChain(chain) {
			if err := r.lookups(ctx, fam, family, chain, rs, sets, maps, cache, fresh, looked, n); err != nil {
				return nil, nil, err
			}
		}
	}
	// Maps announced but gone again (or never looked up) are forgotten.
	var last uint64
	for _, info := range sets {
		last = max(last, info.Handle)
	}
	r.notes.seen(fam, last)
	for chain, rs := range rules {
		out := make([][]Statement, len(rs))
		for i, rule := range rs {
			for _, st := range rule.Stmts {
				out[i] = append(out[i], StatementOf(st, looked))
			}
		}
		t.Chains[chain] = out
	}
	t.Dispatches = Dispatches(rules["services"])
	if t.ServiceIPs, t.NodePorts, t.NoEndpoints, err = MapEntries(family, maps); err != nil {
		return nil, nil, err
	}
	return t, sets, nil
}

// lookups resolves the maps a chain's rules look up into looked: a named
// map read with the table (named), or an anonymous one from the cache
// (by name and handle), from the notifications, or dumped; the anonymous
// ones go into fresh.
func (r *NetlinkReader) lookups(ctx context.Context, fam byte, family int, chain string, rs []Rule, sets map[string]SetInfo,
	named map[string][]Elem, cache, fresh map[string]cachedSet, looked map[string]*LookupMap, n *int64) error {
	for _, rule := range rs {
		for _, st := range rule.Stmts {
			if !(st.VMap || st.DNATMap) || st.Set == "" || looked[st.Set] != nil {
				continue
			}
			if els, ok := named[st.Set]; ok {
				looked[st.Set] = DecodeLookupMap(family, els)
				continue
			}
			info, known := sets[st.Set]
			if c, ok := cache[st.Set]; ok && known && info.Anonymous && c.handle == info.Handle {
				looked[st.Set], fresh[st.Set] = c.m, c
				continue
			}
			var m *LookupMap
			ok := false
			if known && info.Anonymous {
				m, ok = r.notes.take(fam, info.Handle)
			}
			if ok {
				r.noted.Add(1)
			} else {
				els, err := r.elements(ctx, fam, st.Set, n)
				if err != nil {
					return fmt.Errorf("map %s of chain %s: %w", st.Set, chain, err)
				}
				r.dumped.Add(1)
				m = DecodeLookupMap(family, els)
			}
			looked[st.Set] = m
			if known && info.Anonymous {
				fresh[st.Set] = cachedSet{handle: info.Handle, m: m}
			}
		}
	}
	return nil
}

// NewNetlinkReader returns a reader of kube-proxy's nftables tables over
// netlink.
func NewNetlinkReader() *NetlinkReader { return &NetlinkReader{} }
