package nftables

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// This file decodes what the kernel's nf_tables netlink dumps say about
// kube-proxy's table into what the audit reads: each rule as statements
// (matches, DNATs, verdicts, map lookups) and map elements as keys and
// values. Only the attributes the model needs are looked at (of the
// expressions: cmp, lookup, immediate and nat), with a walker over the
// attribute bytes that allocates nothing: at the anchors a read decodes
// ~20k rules and ~110k map elements, and a general decoder (every
// attribute into a slice, every expression into a struct) allocated about
// 30 MB per read for it. Every decoder is pure and fuzzed: the bytes come
// from the kernel, but a bug must never crash the collector or make it
// allocate without bound.

// Rule is one decoded rule: its chain and its statements in order.
type Rule struct {
	Chain string
	Stmts []Stmt
}

// Stmt is a statement before the sets it looks up are known.
type Stmt struct {
	// Match: a condition (cmp, or a lookup that only tests membership).
	Match bool
	// Target is a goto or jump verdict's chain.
	Target string
	// Set is the map a lookup reads: its values are verdicts (vmap) or an
	// address and port a DNAT reads (dnatMap).
	Set     string
	VMap    bool
	DNATMap bool
	// DNAT is a DNAT to an address and port held in immediates.
	DNAT netip.AddrPort
}

// DecodeRule reads one NFT_MSG_NEWRULE message body.
func DecodeRule(data []byte) (Rule, error) {
	var r Rule
	a, err := nl.Body(data, "rule")
	if err != nil {
		return r, err
	}
	d := ruleDecoder{rule: &r}
	for a.Next() {
		switch a.Type {
		case unix.NFTA_RULE_CHAIN:
			r.Chain = a.Str()
		case unix.NFTA_RULE_EXPRESSIONS:
			list := nl.Walk(a.Val)
			n := 0
			for list.Next() {
				if n++; n > nl.MaxRuleExprs {
					return r, fmt.Errorf("nf_tables rule in chain %q: more than %d expressions", clip([]byte(r.Chain)), nl.MaxRuleExprs)
				}
				if err := d.expr(list.Val); err != nil {
					return r, fmt.Errorf("nf_tables rule in chain %q: %w", clip([]byte(r.Chain)), err)
				}
			}
			if list.Err != nil {
				return r, fmt.Errorf("nf_tables rule in chain %q: %w", clip([]byte(r.Chain)), list.Err)
			}
		}
	}
	if a.Err != nil {
		return r, fmt.Errorf("nf_tables rule in chain %q: %w", clip([]byte(r.Chain)), a.Err)
	}
	return r, nil
}

// ruleDecoder decodes one rule's expressions, holding the last immediates
// loaded into registers until a nat expression reads them.
type ruleDecoder struct {
	rule *Rule
	regs [2]struct {
		reg  uint32
		data []byte
	}
	nregs int
}

// expr reads one expression (NFTA_EXPR_NAME, then NFTA_EXPR_DATA) and
// appends what it means to the rule.
func (d *ruleDecoder) expr(b []byte) error {
	a := nl.Walk(b)
	var name []byte
	for a.Next() {
		switch a.Type {
		case unix.NFTA_EXPR_NAME:
			name = a.Val
			if n := len(name); n > 0 && name[n-1] == 0 {
				name = name[:n-1]
			}
		case unix.NFTA_EXPR_DATA:
			var err error
			switch string(name) {
			case "cmp":
				d.rule.Stmts = append(d.rule.Stmts, Stmt{Match: true})
			case "lookup":
				err = d.lookup(a.Val)
			case "immediate":
				err = d.immediate(a.Val)
			case "nat":
				err = d.nat(a.Val)
			}
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
		}
	}
	return a.Err
}

func (d *ruleDecoder) lookup(b []byte) error {
	a := nl.Walk(b)
	var st Stmt
	var dreg uint32
	hasDreg := false
	for a.Next() {
		switch a.Type {
		case unix.NFTA_LOOKUP_SET:
			st.Set = a.Str()
		case unix.NFTA_LOOKUP_DREG:
			dreg, hasDreg = a.U32(), true
		}
	}
	switch {
	case !hasDreg:
		st.Match = true
	case dreg == unix.NFT_REG_VERDICT:
		st.VMap = true
	default:
		st.DNATMap = true
	}
	d.rule.Stmts = append(d.rule.Stmts, st)
	return a.Err
}

func (d *ruleDecoder) immediate(b []byte) error {
	dreg, data, err := nl.DecodeImmediate(b)
	if err != nil {
		return err
	}
	var value []byte
	var target string
	verdict := false
	if data != nil {
		if value, target, verdict, err = nl.DataValue(data); err != nil {
			return err
		}
	}
	switch {
	case verdict && target != "":
		d.rule.Stmts = append(d.rule.Stmts, Stmt{Target: target})
	case !verdict && dreg != unix.NFT_REG_VERDICT:
		d.load(dreg, value)
	}
	return nil
}

func (d *ruleDecoder) nat(b []byte) error {
	n, err := nl.DecodeNAT(b)
	if err == nil && n.Type == unix.NFT_NAT_DNAT {
		d.dnat(n.RegAddrMin, n.RegProtoMin)
	}
	return err
}

// load keeps the last two immediates (a DNAT's address and port).
func (d *ruleDecoder) load(reg uint32, data []byte) {
	if d.nregs == len(d.regs) {
		d.regs[0] = d.regs[1]
		d.nregs--
	}
	d.regs[d.nregs].reg, d.regs[d.nregs].data = reg, data
	d.nregs++
}

func (d *ruleDecoder) loaded(reg uint32) []byte {
	for i := range d.nregs {
		if d.regs[i].reg == reg {
			return d.regs[i].data
		}
	}
	return nil
}

// dnat records a DNAT to the address and port held in immediates; a nat
// reading a map lookup's register is that lookup's DNAT, already a
// statement.
func (d *ruleDecoder) dnat(regAddr, regProto uint32) {
	addr := d.loaded(regAddr)
	if addr == nil {
		return
	}
	ip, ok := netip.AddrFromSlice(addr)
	if !ok {
		return
	}
	var p uint16
	if port := d.loaded(regProto); regProto != 0 && len(port) >= 2 {
		p = binary.BigEndian.Uint16(port)
	}
	d.rule.Stmts = append(d.rule.Stmts, Stmt{DNAT: netip.AddrPortFrom(ip.Unmap(), p)})
}

// Elem is one set or map element: its key and, for maps, its value:
// data bytes, or the target chain of a goto or jump verdict.
type Elem struct {
	Key    []byte
	Data   []byte
	Target string
}

// maxSetElems bounds the elements read from one map: 10k services with a
// few ports each stay far below it.
const maxSetElems = 1 << 20

// DecodeElems reads one NFT_MSG_NEWSETELEM message body and appends its
// elements. The keys and values keep pointing into data.
func DecodeElems(data []byte, out []Elem) ([]Elem, error) {
	a, err := nl.Body(data, "set elements")
	if err != nil {
		return out, err
	}
	for a.Next() {
		if a.Type != unix.NFTA_SET_ELEM_LIST_ELEMENTS {
			continue
		}
		list := nl.Walk(a.Val)
		for list.Next() {
			if len(out) >= maxSetElems {
				return out, fmt.Errorf("nf_tables set elements: more than %d", maxSetElems)
			}
			var el Elem
			e := nl.Walk(list.Val)
			for e.Next() {
				switch e.Type {
				case unix.NFTA_SET_ELEM_KEY:
					el.Key, _, _, err = nl.DataValue(e.Val)
				case unix.NFTA_SET_ELEM_DATA:
					el.Data, el.Target, _, err = nl.DataValue(e.Val)
				}
				if err != nil {
					return out, fmt.Errorf("nf_tables set element: %w", err)
				}
			}
			if e.Err != nil {
				return out, fmt.Errorf("nf_tables set element: %w", e.Err)
			}
			out = append(out, el)
		}
		if list.Err != nil {
			return out, fmt.Errorf("nf_tables set elements: %w", list.Err)
		}
	}
	if a.Err != nil {
		return out, fmt.Errorf("nf_tables set elements: %w", a.Err)
	}
	return out, nil
}

// Element layouts kube-proxy uses: concatenations pad each part to 4
// bytes (nf_tables registers are 32 bits; an address is nl.AddrLen).
//
//	service-ips, no-endpoint-services: ip . inet_proto . inet_service
//	service-nodeports:                 inet_proto . inet_service
//	a DNAT map's value:                ip . inet_service

// ServiceIPKey decodes ip . inet_proto . inet_service.
func ServiceIPKey(family int, k []byte) (audit.FrontendKey, error) {
	n := nl.AddrLen(family)
	if len(k) != n+8 {
		return audit.FrontendKey{}, fmt.Errorf("key of %d bytes, want %d (ip . inet_proto . inet_service)", len(k), n+8)
	}
	ip, _ := netip.AddrFromSlice(k[:n])
	proto, ok := audit.ProtocolName(k[n])
	if !ok {
		return audit.FrontendKey{}, fmt.Errorf("unknown protocol %d", k[n])
	}
	return audit.FrontendKey{IP: ip.Unmap(), Protocol: proto, Port: binary.BigEndian.Uint16(k[n+4:])}, nil
}

// NodePortKey decodes inet_proto . inet_service.
func NodePortKey(family int, k []byte) (audit.FrontendKey, error) {
	if len(k) != 8 {
		return audit.FrontendKey{}, fmt.Errorf("key of %d bytes, want 8 (inet_proto . inet_service)", len(k))
	}
	proto, ok := audit.ProtocolName(k[0])
	if !ok {
		return audit.FrontendKey{}, fmt.Errorf("unknown protocol %d", k[0])
	}
	return audit.NodePortKey(family, proto, binary.BigEndian.Uint16(k[4:])), nil
}

// DNATValue decodes ip . inet_service.
func DNATValue(family int, v []byte) (netip.AddrPort, bool) {
	n := nl.AddrLen(family)
	if len(v) != n+4 {
		return netip.AddrPort{}, false
	}
	ip, ok := netip.AddrFromSlice(v[:n])
	if !ok {
		return netip.AddrPort{}, false
	}
	return netip.AddrPortFrom(ip.Unmap(), binary.BigEndian.Uint16(v[n:])), true
}

// SetInfo is what the table's set list says of one set.
type SetInfo struct {
	Handle    uint64
	Anonymous bool
}

// DecodeSet reads one NFT_MSG_NEWSET message body: the set's name, handle
// and whether it is anonymous (bound to one rule, never changed).
func DecodeSet(data []byte) (string, SetInfo, error) {
	_, name, info, err := DecodeSetNote(data)
	return name, info, err
}

// DecodeSetNote is decodeSet with the set's table (a notification may be
// of any table).
func DecodeSetNote(data []byte) (table, name string, info SetInfo, err error) {
	a, err := nl.Body(data, "set")
	if err != nil {
		return "", "", info, err
	}
	for a.Next() {
		switch a.Type {
		case unix.NFTA_SET_TABLE:
			table = a.Str()
		case unix.NFTA_SET_NAME:
			name = a.Str()
		case nl.NFTASetHandle:
			info.Handle = a.U64()
		case unix.NFTA_SET_FLAGS:
			info.Anonymous = a.U32()&unix.NFT_SET_ANONYMOUS != 0
		}
	}
	return table, name, info, a.Err
}

// ElemsOf reads the table and set an NFT_MSG_NEWSETELEM body is of.
func ElemsOf(data []byte) (table, set string) {
	a, err := nl.Body(data, "set elements")
	if err != nil {
		return "", ""
	}
	for a.Next() {
		switch a.Type {
		case unix.NFTA_SET_ELEM_LIST_TABLE:
			table = a.Str()
		case unix.NFTA_SET_ELEM_LIST_SET:
			set = a.Str()
		}
	}
	return table, set
}

// TableHandle reads NFTA_TABLE_HANDLE from an NFT_MSG_NEWTABLE body.
func TableHandle(data []byte) (uint64, bool) {
	a, err := nl.Body(data, "table")
	if err != nil {
		return 0, false
	}
	for a.Next() {
		if a.Type == nl.NFTATableHandle {
			h := a.U64()
			return h, a.Err == nil
		}
	}
	return 0, false
}

// LookupMap is a map a rule looks up, decoded: the verdict targets of a
// verdict map, or the addresses of a DNAT map.
type LookupMap struct {
	Targets []string
	DNAT    []netip.AddrPort
}

func DecodeLookupMap(family int, els []Elem) *LookupMap {
	m := &LookupMap{}
	for _, el := range els {
		if el.Target != "" {
			m.Targets = append(m.Targets, el.Target)
		}
		if ap, ok := DNATValue(family, el.Data); ok {
			m.DNAT = append(m.DNAT, ap)
		}
	}
	return m
}

// Dispatches says whether the services chain looks up service-ips.
func Dispatches(rules []Rule) bool {
	for _, rule := range rules {
		for _, st := range rule.Stmts {
			if st.VMap && st.Set == "service-ips" {
				return true
			}
		}
	}
	return false
}

// MapEntries decodes the named maps' elements.
func MapEntries(family int, maps map[string][]Elem) (ips, ports []MapEntry, none []audit.FrontendKey, err error) {
	for _, el := range maps["service-ips"] {
		k, err := ServiceIPKey(family, el.Key)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("map service-ips: %w", err)
		}
		ips = append(ips, MapEntry{Key: k, Target: el.Target})
	}
	for _, el := range maps["service-nodeports"] {
		k, err := NodePortKey(family, el.Key)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("map service-nodeports: %w", err)
		}
		ports = append(ports, MapEntry{Key: k, Target: el.Target})
	}
	for _, el := range maps["no-endpoint-services"] {
		if k, err := ServiceIPKey(family, el.Key); err == nil {
			none = append(none, k)
		}
	}
	// A node port with no endpoints: its UDP flows stay pinned to the gone
	// pods even where kube-proxy cleans a service's (1.37 skips node
	// ports without endpoints: pkg/proxy/conntrack/cleanup.go).
	for _, el := range maps["no-endpoint-nodeports"] {
		if k, err := NodePortKey(family, el.Key); err == nil {
			none = append(none, k)
		}
	}
	return ips, ports, none, nil
}

// FrontendChain: the chains a frontend's traffic goes through.
func FrontendChain(chain string) bool {
	for _, p := range []string{"service-", "external-", "local-", "endpoint-"} {
		if strings.HasPrefix(chain, p) {
			return true
		}
	}
	return false
}

// StatementOf turns a decoded StatementOf into the audit's, its maps resolved.
func StatementOf(st Stmt, looked map[string]*LookupMap) Statement {
	var out Statement
	switch {
	case st.Target != "":
		out.Gotos, out.Verdict = []string{st.Target}, true
	case st.VMap && looked[st.Set] != nil:
		out.Gotos = looked[st.Set].Targets
	case st.DNATMap && looked[st.Set] != nil:
		out.DNAT = looked[st.Set].DNAT
	case st.DNAT.IsValid():
		out.DNAT = []netip.AddrPort{st.DNAT}
	}
	return out
}
