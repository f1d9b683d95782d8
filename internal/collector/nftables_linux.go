package collector

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/audit"
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
}

// Note and Lost make the reader a NotificationSink of the change signal.
func (r *nftNetlinkReader) Note(typ, flags uint16, data []byte) { r.notes.Note(typ, flags, data) }

// Lost: see NotificationSink.
func (r *nftNetlinkReader) Lost() { r.notes.Lost() }

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

// kubeProxyTable is the table kube-proxy's nftables mode programs.
const kubeProxyTable = "kube-proxy"

// nftMaps are the named maps the audit reads.
var nftNamedMaps = []string{"service-ips", "service-nodeports", "no-endpoint-services"}

func (r *nftNetlinkReader) Read(ctx context.Context) (*audit.Observed, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
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
	var tables []*audit.NFTTable
	for _, fam := range []int{4, 6} {
		t, err := r.table(ctx, fam, &n)
		if errors.Is(err, unix.ENOENT) {
			// The table is gone: kube-proxy's rules of this family were
			// removed (or the kernel has no IPv6: then no service of
			// the family can exist either). Read, and empty.
			t, err = &audit.NFTTable{Family: fam}, nil
		}
		if err != nil {
			// A broken socket is reopened on the next read.
			r.conn.Close()
			r.conn = nil
			return nil, fmt.Errorf("read table %s %s over netlink: %w", nftFamily(fam), kubeProxyTable, err)
		}
		tables = append(tables, t)
	}
	return audit.FromNFTables(tables...)
}

// table reads kube-proxy's table of one family; n counts the bytes read.
func (r *nftNetlinkReader) table(ctx context.Context, family int, n *int64) (*audit.NFTTable, error) {
	fam := byte(unix.NFPROTO_IPV4)
	if family == 6 {
		fam = unix.NFPROTO_IPV6
	}
	// The table's handle first: a table deleted and created again during
	// the read numbers its sets anew, and the cache must not serve them.
	handle, err := r.handleOfTable(ctx, fam)
	if err != nil {
		return nil, err
	}
	rules := map[string][]nftRule{}
	err = r.dump(ctx, unix.NFT_MSG_GETRULE, fam, []netlink.Attribute{{Type: unix.NFTA_RULE_TABLE, Data: cstring(kubeProxyTable)}}, n,
		func(data []byte) error {
			rule, err := decodeRule(data)
			if err != nil {
				return err
			}
			rules[rule.chain] = append(rules[rule.chain], rule)
			return nil
		})
	if err != nil {
		return nil, err
	}
	t := &audit.NFTTable{Family: family, Chains: make(map[string][][]audit.NFTStatement, len(rules))}
	sets, err := r.sets(ctx, fam, n)
	if err != nil {
		return nil, err
	}
	maps := map[string][]nftElem{}
	for _, name := range nftNamedMaps {
		els, err := r.elements(ctx, fam, name, n)
		if err != nil && !errors.Is(err, unix.ENOENT) {
			return nil, fmt.Errorf("map %s: %w", name, err)
		}
		maps[name] = els
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
		if !frontendChain(chain) {
			continue
		}
		for _, rule := range rs {
			for _, st := range rule.stmts {
				if !(st.vmap || st.dnatMap) || st.set == "" || looked[st.set] != nil {
					continue
				}
				if els, ok := maps[st.set]; ok { // a named map, read above
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
						return nil, fmt.Errorf("map %s of chain %s: %w", st.set, chain, err)
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
	}
	// Maps announced but gone again (or never looked up) are forgotten.
	var last uint64
	for _, info := range sets {
		last = max(last, info.handle)
	}
	r.notes.seen(fam, last)
	for chain, rs := range rules {
		out := make([][]audit.NFTStatement, len(rs))
		for i, rule := range rs {
			for _, st := range rule.stmts {
				out[i] = append(out[i], statement(st, looked))
				if chain == "services" && st.vmap && st.set == "service-ips" {
					t.Dispatches = true
				}
			}
		}
		t.Chains[chain] = out
	}
	for _, el := range maps["service-ips"] {
		k, err := serviceIPKey(family, el.key)
		if err != nil {
			return nil, fmt.Errorf("map service-ips: %w", err)
		}
		t.ServiceIPs = append(t.ServiceIPs, audit.NFTMapEntry{Key: k, Target: el.target})
	}
	for _, el := range maps["service-nodeports"] {
		k, err := nodePortKey(family, el.key)
		if err != nil {
			return nil, fmt.Errorf("map service-nodeports: %w", err)
		}
		t.NodePorts = append(t.NodePorts, audit.NFTMapEntry{Key: k, Target: el.target})
	}
	for _, el := range maps["no-endpoint-services"] {
		if k, err := serviceIPKey(family, el.key); err == nil {
			t.NoEndpoints = append(t.NoEndpoints, k)
		}
	}
	return t, nil
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
func statement(st nftStmt, looked map[string]*lookupMap) audit.NFTStatement {
	var out audit.NFTStatement
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

// dump sends one nf_tables dump request and hands each reply's body to fn.
func (r *nftNetlinkReader) dump(ctx context.Context, msg uint16, fam byte, attrs []netlink.Attribute, n *int64, fn func([]byte) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	body, err := netlink.MarshalAttributes(attrs)
	if err != nil {
		return err
	}
	req := netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | msg), Flags: netlink.Request | netlink.Dump},
		Data:   append([]byte{fam, unix.NFNETLINK_V0, 0, 0}, body...),
	}
	sent, err := r.conn.Send(req)
	if err != nil {
		return err
	}
	// Receive gathers every part of the dump (up to the kernel's done
	// message, which it drops) and returns the kernel's errors.
	msgs, err := r.conn.Receive()
	if err != nil {
		return err
	}
	for _, m := range msgs {
		if m.Header.Sequence != sent.Header.Sequence || m.Header.Type == netlink.Done || m.Header.Type == netlink.Error {
			continue
		}
		*n += int64(len(m.Data)) + 16
		if err := fn(m.Data); err != nil {
			return err
		}
	}
	return nil
}

func cstring(s string) []byte { return append([]byte(s), 0) }

func newNFTNetlinkReader() RuleReader { return &nftNetlinkReader{} }
