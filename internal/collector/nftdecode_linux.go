package collector

import (
	"encoding/binary"
	"fmt"
	"net/netip"

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

// nftRule is one decoded rule: its chain and its statements in order.
type nftRule struct {
	chain string
	stmts []nftStmt
}

// nftStmt is a statement before the sets it looks up are known.
type nftStmt struct {
	// match: a condition (cmp, or a lookup that only tests membership).
	match bool
	// target is a goto or jump verdict's chain.
	target string
	// set is the map a lookup reads: its values are verdicts (vmap) or an
	// address and port a DNAT reads (dnatMap).
	set     string
	vmap    bool
	dnatMap bool
	// dnat is a DNAT to an address and port held in immediates.
	dnat netip.AddrPort
}

// decodeRule reads one NFT_MSG_NEWRULE message body.
func decodeRule(data []byte) (nftRule, error) {
	var r nftRule
	a, err := nl.Body(data, "rule")
	if err != nil {
		return r, err
	}
	d := ruleDecoder{rule: &r}
	for a.Next() {
		switch a.Type {
		case unix.NFTA_RULE_CHAIN:
			r.chain = a.Str()
		case unix.NFTA_RULE_EXPRESSIONS:
			list := nl.Walk(a.Val)
			n := 0
			for list.Next() {
				if n++; n > nl.MaxRuleExprs {
					return r, fmt.Errorf("nf_tables rule in chain %q: more than %d expressions", clip(r.chain), nl.MaxRuleExprs)
				}
				if err := d.expr(list.Val); err != nil {
					return r, fmt.Errorf("nf_tables rule in chain %q: %w", clip(r.chain), err)
				}
			}
			if list.Err != nil {
				return r, fmt.Errorf("nf_tables rule in chain %q: %w", clip(r.chain), list.Err)
			}
		}
	}
	if a.Err != nil {
		return r, fmt.Errorf("nf_tables rule in chain %q: %w", clip(r.chain), a.Err)
	}
	return r, nil
}

// ruleDecoder decodes one rule's expressions, holding the last immediates
// loaded into registers until a nat expression reads them.
type ruleDecoder struct {
	rule *nftRule
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
				d.rule.stmts = append(d.rule.stmts, nftStmt{match: true})
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
	var st nftStmt
	var dreg uint32
	hasDreg := false
	for a.Next() {
		switch a.Type {
		case unix.NFTA_LOOKUP_SET:
			st.set = a.Str()
		case unix.NFTA_LOOKUP_DREG:
			dreg, hasDreg = a.U32(), true
		}
	}
	switch {
	case !hasDreg:
		st.match = true
	case dreg == unix.NFT_REG_VERDICT:
		st.vmap = true
	default:
		st.dnatMap = true
	}
	d.rule.stmts = append(d.rule.stmts, st)
	return a.Err
}

func (d *ruleDecoder) immediate(b []byte) error {
	a := nl.Walk(b)
	var dreg uint32
	var value []byte
	var target string
	verdict := false
	for a.Next() {
		switch a.Type {
		case unix.NFTA_IMMEDIATE_DREG:
			dreg = a.U32()
		case unix.NFTA_IMMEDIATE_DATA:
			var err error
			value, target, verdict, err = nl.DataValue(a.Val)
			if err != nil {
				return err
			}
		}
	}
	if a.Err != nil {
		return a.Err
	}
	switch {
	case verdict && target != "":
		d.rule.stmts = append(d.rule.stmts, nftStmt{target: target})
	case !verdict && dreg != unix.NFT_REG_VERDICT:
		d.load(dreg, value)
	}
	return nil
}

func (d *ruleDecoder) nat(b []byte) error {
	a := nl.Walk(b)
	var typ, regAddr, regProto uint32
	for a.Next() {
		switch a.Type {
		case unix.NFTA_NAT_TYPE:
			typ = a.U32()
		case unix.NFTA_NAT_REG_ADDR_MIN:
			regAddr = a.U32()
		case unix.NFTA_NAT_REG_PROTO_MIN:
			regProto = a.U32()
		}
	}
	if a.Err == nil && typ == unix.NFT_NAT_DNAT {
		d.dnat(regAddr, regProto)
	}
	return a.Err
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
	d.rule.stmts = append(d.rule.stmts, nftStmt{dnat: netip.AddrPortFrom(ip.Unmap(), p)})
}

// nftElem is one set or map element: its key and, for maps, its value:
// data bytes, or the target chain of a goto or jump verdict.
type nftElem struct {
	key    []byte
	data   []byte
	target string
}

// maxSetElems bounds the elements read from one map: 10k services with a
// few ports each stay far below it.
const maxSetElems = 1 << 20

// decodeElems reads one NFT_MSG_NEWSETELEM message body and appends its
// elements. The keys and values keep pointing into data.
func decodeElems(data []byte, out []nftElem) ([]nftElem, error) {
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
			var el nftElem
			e := nl.Walk(list.Val)
			for e.Next() {
				switch e.Type {
				case unix.NFTA_SET_ELEM_KEY:
					el.key, _, _, err = nl.DataValue(e.Val)
				case unix.NFTA_SET_ELEM_DATA:
					el.data, el.target, _, err = nl.DataValue(e.Val)
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

// serviceIPKey decodes ip . inet_proto . inet_service.
func serviceIPKey(family int, k []byte) (audit.FrontendKey, error) {
	n := nl.AddrLen(family)
	if len(k) != n+8 {
		return audit.FrontendKey{}, fmt.Errorf("key of %d bytes, want %d (ip . inet_proto . inet_service)", len(k), n+8)
	}
	ip, _ := netip.AddrFromSlice(k[:n])
	proto, ok := protoName(k[n])
	if !ok {
		return audit.FrontendKey{}, fmt.Errorf("unknown protocol %d", k[n])
	}
	return audit.FrontendKey{IP: ip.Unmap(), Protocol: proto, Port: binary.BigEndian.Uint16(k[n+4:])}, nil
}

// nodePortKey decodes inet_proto . inet_service.
func nodePortKey(family int, k []byte) (audit.FrontendKey, error) {
	if len(k) != 8 {
		return audit.FrontendKey{}, fmt.Errorf("key of %d bytes, want 8 (inet_proto . inet_service)", len(k))
	}
	proto, ok := protoName(k[0])
	if !ok {
		return audit.FrontendKey{}, fmt.Errorf("unknown protocol %d", k[0])
	}
	return audit.NodePortKey(family, proto, binary.BigEndian.Uint16(k[4:])), nil
}

// dnatValue decodes ip . inet_service.
func dnatValue(family int, v []byte) (netip.AddrPort, bool) {
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

// setInfo is what the table's set list says of one set.
type setInfo struct {
	handle    uint64
	anonymous bool
}

// decodeSet reads one NFT_MSG_NEWSET message body: the set's name, handle
// and whether it is anonymous (bound to one rule, never changed).
func decodeSet(data []byte) (string, setInfo, error) {
	_, name, info, err := decodeSetNote(data)
	return name, info, err
}

// decodeSetNote is decodeSet with the set's table (a notification may be
// of any table).
func decodeSetNote(data []byte) (table, name string, info setInfo, err error) {
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
		case nftaSetHandle:
			info.handle = a.U64()
		case unix.NFTA_SET_FLAGS:
			info.anonymous = a.U32()&unix.NFT_SET_ANONYMOUS != 0
		}
	}
	return table, name, info, a.Err
}

// elemsOf reads the table and set an NFT_MSG_NEWSETELEM body is of.
func elemsOf(data []byte) (table, set string) {
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

// Attributes golang.org/x/sys does not name (linux/netfilter/nf_tables.h).
const (
	nftaSetHandle   = 16 // NFTA_SET_HANDLE
	nftaTableHandle = 4  // NFTA_TABLE_HANDLE
)

// tableHandle reads NFTA_TABLE_HANDLE from an NFT_MSG_NEWTABLE body.
func tableHandle(data []byte) (uint64, bool) {
	a, err := nl.Body(data, "table")
	if err != nil {
		return 0, false
	}
	for a.Next() {
		if a.Type == nftaTableHandle {
			h := a.U64()
			return h, a.Err == nil
		}
	}
	return 0, false
}

func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
