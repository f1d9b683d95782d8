package iptables

import (
	"encoding/binary"
	"fmt"
	"hash/maphash"
	"net/netip"
	"sort"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// The legacy (x_tables) backend's nat table as IPT_SO_GET_ENTRIES (and
// IP6T_SO_GET_ENTRIES) hands it over: one blob of entries, decoded in
// place into what the text parser takes from iptables-legacy-save's
// output. The collector's reader makes the getsockopt; this is pure and
// fuzzed.

const (
	xtTargetHead = 32 // struct xt_entry_target / xt_entry_match header
	iptFGoto     = 0x02
	ip6tFGoto    = 0x04
	ip6tFProto   = 0x01
	iptInvSrcIP  = 0x08
	iptInvDstIP  = 0x10
	xtReturn     = -5 // -NF_REPEAT - 1
)

// entryLayout is where an entry's fields sit in one family.
type entryLayout struct {
	size, addrLen                  int
	src, dst, smsk, dmsk           int
	proto, flags, invflags         int
	targetOffset, nextOffset, goTo int
}

var layouts = map[int]entryLayout{
	4: {size: 112, addrLen: 4, src: 0, dst: 4, smsk: 8, dmsk: 12, proto: 80, flags: 82, invflags: 83, targetOffset: 88, nextOffset: 90, goTo: iptFGoto},
	6: {size: 168, addrLen: 16, src: 0, dst: 16, smsk: 32, dmsk: 48, proto: 128, flags: 131, invflags: 132, targetOffset: 140, nextOffset: 142, goTo: ip6tFGoto},
}

// decodeLegacy walks a table's entries (the blob IPT_SO_GET_ENTRIES
// returns) and hands each user chain the audit reads its rules, as
// iptables-legacy-save prints them: a user chain is an ERROR target
// naming it, its rules, and a RETURN that ends it (not printed); jumps
// are offsets of the chain's first entry. Built-in chains are not read.
//
// A chain is decoded only when known, told its rule count, says its
// entries' digest is new:
// the digest is of the entries' bytes without their packet counters,
// with each jump's offset replaced by its target's name (a chain that
// grew shifts every offset after it). kube-proxy replaces the whole
// table at every sync; most chains come back byte for byte. Pure; fuzzed.
func decodeLegacy(table []byte, lay entryLayout, fam int, seed maphash.Seed, known func(chain string, sum uint64, rules int) bool,
	emit func(chain string, rules []Rule) error) error {
	// The user chains: where each starts (its first entry after the head)
	// and its name, in table order.
	type head struct {
		off, first int
		name       string
	}
	var heads []head
	for off := 0; off < len(table); {
		next, tname, tdata, err := entryAt(table, off, lay)
		if err != nil {
			return err
		}
		if string(tname) == "ERROR" {
			if name := nl.CStr(tdata); string(name) != "ERROR" {
				// One string per chain, shared by every jump to it.
				heads = append(heads, head{off: off, first: off + next, name: string(name)})
			}
		}
		off += next
	}
	chainAt := func(target int) (string, bool) {
		i := sort.Search(len(heads), func(i int) bool { return heads[i].first >= target })
		if i < len(heads) && heads[i].first == target {
			return heads[i].name, true
		}
		return "", false
	}
	var rules []Rule
	var offs []int
	for h, hd := range heads {
		end := len(table)
		if h+1 < len(heads) {
			end = heads[h+1].off
		}
		name := hd.name
		if !Reads(name) {
			continue
		}
		rules, offs = rules[:0], offs[:0]
		// The chain's entries up to its ending RETURN (the last entry
		// before the next chain, or before the table's end marker).
		for off := hd.first; off < end; {
			next, tname, _, err := entryAt(table, off, lay)
			if err != nil {
				return err
			}
			if string(tname) == "ERROR" {
				break
			}
			offs = append(offs, off)
			off += next
		}
		if len(offs) == 0 {
			return fmt.Errorf("chain %s has no end", clip([]byte(name)))
		}
		if known(name, chainDigest(table, offs[:len(offs)-1], lay, seed, chainAt), len(offs)-1) {
			continue
		}
		for _, off := range offs[:len(offs)-1] {
			rule, err := decodeLegacyEntry(table, off, lay, fam, chainAt, name)
			if err != nil {
				return fmt.Errorf("chain %s: %w", clip([]byte(name)), err)
			}
			rules = append(rules, rule)
		}
		if err := emit(name, rules); err != nil {
			return err
		}
	}
	return nil
}

// chainDigest digests a chain's rule entries (checked by entryAt): their
// bytes up to the counters and from the matches on, a jump's offset
// replaced by its target chain's name.
func chainDigest(table []byte, offs []int, lay entryLayout, seed maphash.Seed, chainAt func(int) (string, bool)) uint64 {
	var h maphash.Hash
	h.SetSeed(seed)
	counters := lay.nextOffset + 2 // comefrom, then the counters, end the header
	for _, off := range offs {
		e := table[off:]
		to := int(binary.NativeEndian.Uint16(e[lay.targetOffset:]))
		next := int(binary.NativeEndian.Uint16(e[lay.nextOffset:]))
		h.Write(e[:counters])
		h.Write(e[lay.size:to])
		t := e[to:next]
		if tsize := int(binary.NativeEndian.Uint16(t)); t[2] == 0 && tsize >= xtTargetHead+4 {
			// The standard target: a verdict, or a jump by offset.
			h.Write(t[:xtTargetHead])
			v := int32(binary.NativeEndian.Uint32(t[xtTargetHead:]))
			if int(v) == off+next {
				h.WriteByte(1) // fall-through
			} else if name, ok := chainAt(int(v)); ok && v >= 0 {
				h.WriteString(name)
			} else {
				h.Write(t[xtTargetHead : xtTargetHead+4])
			}
		} else {
			h.Write(t)
		}
		h.WriteByte(0)
	}
	return h.Sum64()
}

// entryAt checks the entry at off and returns its length and its
// target's name and data.
func entryAt(table []byte, off int, lay entryLayout) (next int, tname, tdata []byte, err error) {
	if off+lay.size > len(table) {
		return 0, nil, nil, fmt.Errorf("entry at %d: truncated", off)
	}
	e := table[off:]
	to := int(binary.NativeEndian.Uint16(e[lay.targetOffset:]))
	next = int(binary.NativeEndian.Uint16(e[lay.nextOffset:]))
	if to < lay.size || to+xtTargetHead > next || off+next > len(table) || next%8 != 0 {
		return 0, nil, nil, fmt.Errorf("entry at %d: target at %d, next at %d", off, to, next)
	}
	t := e[to:next]
	tsize := int(binary.NativeEndian.Uint16(t))
	if tsize < xtTargetHead || tsize > len(t) {
		return 0, nil, nil, fmt.Errorf("entry at %d: target of %d bytes", off, tsize)
	}
	return next, nl.CStr(t[2:31]), t[xtTargetHead:tsize], nil
}

// decodeLegacyEntry reads one rule as iptables-legacy-save prints it.
func decodeLegacyEntry(table []byte, off int, lay entryLayout, fam int, chainAt func(int) (string, bool), chain string) (Rule, error) {
	e := table[off:]
	d := iptDecoder{fam: fam, strict: chain == "KUBE-SERVICES" || chain == "KUBE-NODEPORTS" ||
		len(chain) > 9 && (chain[:9] == "KUBE-EXT-" || chain[:8] == "KUBE-FW-")}
	inv := e[lay.invflags]
	if !allZero(e[lay.smsk : lay.smsk+lay.addrLen]) {
		d.r.Cond = true // -s
	}
	if dmsk := e[lay.dmsk : lay.dmsk+lay.addrLen]; !allZero(dmsk) {
		if allOnes(dmsk) && inv&iptInvDstIP == 0 {
			ip, _ := netip.AddrFromSlice(e[lay.dst : lay.dst+lay.addrLen])
			d.r.Dst = ip.Unmap()
		} else {
			d.r.Cond = true
		}
	}
	proto := binary.NativeEndian.Uint16(e[lay.proto:])
	if fam == 6 && e[lay.flags]&ip6tFProto == 0 {
		proto = 0
	}
	if proto != 0 {
		// "! -p tcp" reads as TCP in the text parser too.
		name, ok := audit.ProtocolName(byte(proto))
		if !ok || proto > 255 {
			if d.strict {
				return d.r, undecodable("protocol %d", proto)
			}
		} else {
			d.r.Proto = name
		}
	}
	to := int(binary.NativeEndian.Uint16(e[lay.targetOffset:]))
	// The matches, from the entry's end to its target.
	for m := lay.size; m < to; {
		if m+xtTargetHead > to {
			return d.r, fmt.Errorf("a match header past the target")
		}
		msize := int(binary.NativeEndian.Uint16(e[m:]))
		if msize < xtTargetHead || m+msize > to {
			return d.r, fmt.Errorf("a match of %d bytes", msize)
		}
		if err := d.match(nl.CStr(e[m+2:m+31]), e[m+xtTargetHead:m+msize]); err != nil {
			return d.r, err
		}
		m += msize
	}
	next := int(binary.NativeEndian.Uint16(e[lay.nextOffset:]))
	t := e[to:next]
	tsize := int(binary.NativeEndian.Uint16(t))
	tname := nl.CStr(t[2:31])
	data := t[xtTargetHead:tsize]
	if len(tname) > 0 {
		d.r.Jump = targetName(tname)
		if string(tname) == "DNAT" {
			if err := d.dnat(uint32(t[31]), data); err != nil {
				return d.r, err
			}
		}
		return d.r, nil
	}
	// The standard target: a verdict, or a jump to a chain's first entry.
	if len(data) < 4 {
		return d.r, fmt.Errorf("a standard target of %d bytes", len(data))
	}
	switch v := int32(binary.NativeEndian.Uint32(data)); {
	case int(v) == off+next:
		// A rule without a target: libiptc's fall-through to the next
		// entry (iptables-save prints no -j).
	case v >= 0:
		name, ok := chainAt(int(v))
		if !ok {
			return d.r, fmt.Errorf("a jump to offset %d, where no chain starts", v)
		}
		d.r.Jump, d.r.Goto = name, e[lay.flags]&byte(lay.goTo) != 0
	case v == -nfAccept-1:
		d.r.Jump = "ACCEPT"
	case v == -nfDrop-1:
		d.r.Jump = "DROP"
	case v == xtReturn:
		d.r.Jump = "RETURN"
	}
	return d.r, nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// DecodeLegacy walks the nat table's entries of family fam (4 or 6) as
// IPT_SO_GET_ENTRIES returns them (see decodeLegacy).
func DecodeLegacy(table []byte, fam int, seed maphash.Seed, known func(chain string, sum uint64, rules int) bool,
	emit func(chain string, rules []Rule) error) error {
	lay, ok := layouts[fam]
	if !ok {
		return fmt.Errorf("no IPv%d legacy table layout", fam)
	}
	return decodeLegacy(table, lay, fam, seed, known, emit)
}

// LegacyHasChain says whether a table's entries (of family fam) hold the
// user chain named chain.
func LegacyHasChain(table []byte, fam int, chain string) (bool, error) {
	lay, ok := layouts[fam]
	if !ok {
		return false, fmt.Errorf("no IPv%d legacy table layout", fam)
	}
	for off := 0; off < len(table); {
		next, tname, tdata, err := entryAt(table, off, lay)
		if err != nil {
			return false, err
		}
		if string(tname) == "ERROR" && string(nl.CStr(tdata)) == chain {
			return true, nil
		}
		off += next
	}
	return false, nil
}
