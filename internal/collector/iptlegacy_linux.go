package collector

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	"net/netip"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/iptables"
)

// legacyReader reads the legacy (x_tables) backend's nat tables without
// running a tool: one IPT_SO_GET_ENTRIES (IP6T_SO_GET_ENTRIES for IPv6)
// per family, the getsockopt iptables-legacy-save itself uses, decoded in
// place. The kernel hands the whole table over at once (there is no
// partial read), so each read decodes every entry, but only chains whose
// decoded rules changed since the last read go into the model, and only
// the frontends they touch are reported.
//
// A rule the decoder does not understand in a chain the audit reads makes
// that read fall back to iptables-legacy-save (counted), as on nf_tables.
type legacyReader struct {
	mu   sync.Mutex
	fds  [2]int // raw sockets, IPv4 and IPv6; -1: not open
	fams [2]*legacyFamily
	// text reads one family with iptables-legacy-save when the decoder
	// cannot; nil: no tool.
	text  func(ctx context.Context, fam int) (*audit.Observed, error)
	bytes atomic.Int64
	// reads, chains set (changed since the last read), fallbacks and the
	// last one's reason.
	reads, chains, fallbacks atomic.Int64
	lastFallback             atomic.Value // string
	// seed digests chains' entries (see decodeLegacy).
	seed maphash.Seed
	// omitChains: see iptNFTReader.
	omitChains bool
}

// legacyFamily is one family's model and what each chain held at the
// last read (a digest of its entries, by a hash of its name).
type legacyFamily struct {
	nat  *iptables.NAT
	sums map[uint64]chainSum
	gen  uint32
	// entries is the table's entry count and dispatch the rules of its
	// KUBE-SERVICES at the last read (see Flushed).
	entries, dispatch int
}

type chainSum struct {
	sum uint64
	gen uint32
}

func newLegacyReader(text func(ctx context.Context, fam int) (*audit.Observed, error)) *legacyReader {
	return &legacyReader{fds: [2]int{-1, -1}, text: text, seed: maphash.MakeSeed()}
}

var (
	_ RuleReader   = (*legacyReader)(nil)
	_ ChangeReader = (*legacyReader)(nil)
)

func (r *legacyReader) String() string { return "iptables (legacy backend, getsockopt)" }

// Source is where the reader reads from.
func (r *legacyReader) Source() Source { return Source{Mode: audit.ModeIPTables, Legacy: true} }

// BytesRead is the size of the tables the last read received.
func (r *legacyReader) BytesRead() int64 { return r.bytes.Load() }

// Read reads both families whole.
func (r *legacyReader) Read(ctx context.Context) (*audit.Observed, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fams = [2]*legacyFamily{}
	r.omitChains = false
	ch, err := r.read(ctx)
	if err != nil {
		return nil, err
	}
	return ch.Whole, nil
}

// ReadChanges reads what changed since the last read.
func (r *legacyReader) ReadChanges(ctx context.Context) (*Changes, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.omitChains = true // streamed: the stream carries no endpoint chain names
	return r.read(ctx)
}

func (r *legacyReader) read(ctx context.Context) (*Changes, error) {
	r.reads.Add(1)
	var n int64
	defer func() { r.bytes.Store(n) }()
	whole := false
	var parts []*audit.Observed
	var changed []audit.ObservedFrontend
	var removed []audit.FrontendKey
	for i, fam := range []int{4, 6} {
		f := r.fams[i]
		first := f == nil
		if first {
			f = &legacyFamily{nat: iptables.NewNAT(fam), sums: map[uint64]chainSum{}}
		}
		f.nat.OmitEndpointChains = r.omitChains
		err := r.readFamily(ctx, fam, f, &n)
		switch {
		case errors.Is(err, ErrUndecodable) && r.text != nil:
			r.fallbacks.Add(1)
			r.lastFallback.Store(err.Error())
			obs, terr := r.text(ctx, fam)
			if terr != nil {
				r.fams = [2]*legacyFamily{}
				return nil, fmt.Errorf("IPv%d rules: %v, and the fallback failed: %w", fam, err, terr)
			}
			r.fams = [2]*legacyFamily{}
			parts, whole = append(parts, obs), true
			continue
		case err != nil:
			r.fams = [2]*legacyFamily{}
			return nil, err
		}
		r.fams[i] = f
		c, rm := f.nat.Changes()
		if first {
			whole = true
			parts = append(parts, &audit.Observed{Mode: audit.ModeIPTables, Families: []int{fam}, Frontends: c, NoRules: len(c) == 0})
			continue
		}
		changed = append(changed, c...)
		removed = append(removed, rm...)
		parts = append(parts, nil)
	}
	if whole {
		// A family read whole (or by the tool) makes the read whole.
		for i, fam := range []int{4, 6} {
			if parts[i] == nil {
				if f := r.fams[i]; f != nil {
					parts[i] = f.nat.Observed()
				} else {
					parts[i] = &audit.Observed{Mode: audit.ModeIPTables, Families: []int{fam}, NoRules: true}
				}
			}
		}
		if r.fams[0] == nil || r.fams[1] == nil {
			// After a fallback no family keeps a base: the next read is
			// whole again.
			r.fams = [2]*legacyFamily{}
		}
		obs, err := audit.Merge(parts...)
		if err != nil {
			r.fams = [2]*legacyFamily{}
			return nil, err
		}
		return &Changes{Whole: obs}, nil
	}
	sort.Slice(changed, func(a, b int) bool { return changed[a].FrontendKey.Compare(changed[b].FrontendKey) < 0 })
	sort.Slice(removed, func(a, b int) bool { return removed[a].Compare(removed[b]) < 0 })
	return &Changes{Frontends: changed, Removed: removed, Families: []int{4, 6}, Mode: audit.ModeIPTables,
		NoRules: r.fams[0].nat.Len()+r.fams[1].nat.Len() == 0}, nil
}

// x_tables getsockopt numbers and the layouts of struct ipt_entry and
// struct ip6t_entry (linux/netfilter_ipv{4,6}/ip{,6}_tables.h; checked
// against the headers with offsetof on amd64).
const (
	iptSoGetEntries = 65 // IPT_SO_GET_ENTRIES = IP6T_SO_GET_ENTRIES
	getEntriesHead  = 40 // struct ipt_get_entries without its entries
	xtTargetHead    = 32 // struct xt_entry_target / xt_entry_match header
	iptFGoto        = 0x02
	ip6tFGoto       = 0x04
	ip6tFProto      = 0x01
	iptInvSrcIP     = 0x08
	iptInvDstIP     = 0x10
	xtReturn        = -5 // -NF_REPEAT - 1
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

// readFamily reads one family's nat table and puts the chains whose rules
// changed into f. A kernel without the table (no legacy nat in this
// namespace) reads as an empty one.
func (r *legacyReader) readFamily(ctx context.Context, fam int, f *legacyFamily, n *int64) error {
	i := fam / 6
	if r.fds[i] < 0 {
		af := unix.AF_INET
		if fam == 6 {
			af = unix.AF_INET6
		}
		fd, err := unix.Socket(af, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
		if err != nil {
			return fmt.Errorf("open a raw socket for IPT_SO_GET_ENTRIES: %w (the collector needs NET_RAW)", err)
		}
		r.fds[i] = fd
	}
	level := unix.SOL_IP
	if fam == 6 {
		level = unix.SOL_IPV6
	}
	var blob []byte
	for try := 0; ; try++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		info, errno := natInfo(r.fds[i], level)
		if errno == syscall.ENOENT {
			f.entries = 0
			return r.apply(f, nil, layouts[fam], fam)
		}
		if errno != 0 {
			return fmt.Errorf("%s IPT_SO_GET_INFO nat: %w", legacyTool(fam), errno)
		}
		// The table lives outside the Go heap: it can be tens of MB, and
		// is given back to the system as soon as it is decoded.
		buf, err := unix.Mmap(-1, 0, getEntriesHead+int(info.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			return fmt.Errorf("%s: room for a table of %d bytes: %w", legacyTool(fam), info.Size, err)
		}
		// Huge pages where the kernel gives them on request: a table of
		// 100 MB is 25,000 page faults in 4 KiB pages.
		_ = unix.Madvise(buf, unix.MADV_HUGEPAGE)
		copy(buf, "nat")
		binary.NativeEndian.PutUint32(buf[32:], info.Size)
		l := uint32(len(buf))
		_, _, errno = unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(r.fds[i]), uintptr(level), iptSoGetEntries,
			uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&l)), 0)
		if errno == syscall.EAGAIN && try < 10 {
			// The table changed between the two calls.
			unix.Munmap(buf)
			continue
		}
		if errno != 0 {
			unix.Munmap(buf)
			return fmt.Errorf("%s IPT_SO_GET_ENTRIES nat: %w", legacyTool(fam), errno)
		}
		*n += int64(info.Size)
		f.entries = int(info.NumEntries)
		blob = buf
		err = r.apply(f, buf[getEntriesHead:getEntriesHead+int(info.Size)], layouts[fam], fam)
		unix.Munmap(blob)
		return err
	}
}

// natInfo asks for the nat table's info (IPT_SO_GET_INFO; IP6T_SO_GET_INFO
// has its number and struct) on a raw socket of level's family.
func natInfo(fd, level int) (iptGetinfo, syscall.Errno) {
	var info iptGetinfo
	copy(info.Name[:], "nat")
	size := uint32(unsafe.Sizeof(info))
	_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), iptSoGetInfo,
		uintptr(unsafe.Pointer(&info)), uintptr(unsafe.Pointer(&size)), 0)
	return info, errno
}

// Flushed: a family that had KUBE-SERVICES rules at the last read lost
// its nat table, or at least half as many entries as KUBE-SERVICES held
// (a flush of the table, or of KUBE-SERVICES). kube-proxy replaces the
// whole table at each sync, keeping its size but for what changed.
func (r *legacyReader) Flushed(context.Context) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, level := range []int{unix.SOL_IP, unix.SOL_IPV6} {
		f := r.fams[i]
		if f == nil || f.dispatch == 0 || r.fds[i] < 0 {
			continue
		}
		info, errno := natInfo(r.fds[i], level)
		if errno == syscall.ENOENT || (errno == 0 && 2*(f.entries-int(info.NumEntries)) >= f.dispatch) {
			return true
		}
	}
	return false
}

func legacyTool(fam int) string {
	if fam == 6 {
		return "ip6tables-legacy"
	}
	return "iptables-legacy"
}

// apply decodes a table's entries and puts the chains the audit reads
// whose rules differ from the last read into f's model; chains gone are
// deleted.
func (r *legacyReader) apply(f *legacyFamily, table []byte, lay entryLayout, fam int) error {
	f.gen++
	seen, fresh := 0, 0
	f.dispatch = 0
	known := func(chain string, sum uint64, rules int) bool {
		if chain == "KUBE-SERVICES" {
			f.dispatch = rules
		}
		k := nameHash(chain)
		old, ok := f.sums[k]
		f.sums[k] = chainSum{sum: sum, gen: f.gen}
		seen++
		if !ok {
			fresh++
		}
		return ok && old.sum == sum
	}
	err := decodeLegacy(table, lay, fam, r.seed, known, func(chain string, rules []iptables.Rule) error {
		r.chains.Add(1)
		return f.nat.SetChain(chain, rules)
	})
	if err != nil {
		return err
	}
	if fresh == 0 && seen == len(f.sums) {
		// Every chain of the last read, and no other: none is gone.
		return nil
	}
	var gone []string
	f.nat.Chains(func(name string) {
		if s, ok := f.sums[nameHash(name)]; !ok || s.gen != f.gen {
			gone = append(gone, name)
		}
	})
	for _, name := range gone {
		f.nat.DeleteChain(name)
	}
	for k, s := range f.sums {
		if s.gen != f.gen {
			delete(f.sums, k)
		}
	}
	return nil
}

// fnv64 is FNV-1a, inline (hash/fnv's allocates a hasher per call, and a
// read digests every chain).
type fnv64 uint64

const fnvOffset, fnvPrime = 14695981039346656037, 1099511628211

func (h *fnv64) str(s string) {
	for i := 0; i < len(s); i++ {
		*h = (*h ^ fnv64(s[i])) * fnvPrime
	}
	*h = (*h ^ 0xff) * fnvPrime // the end of a string
}

func nameHash(s string) uint64 {
	h := fnv64(fnvOffset)
	h.str(s)
	return uint64(h)
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
	emit func(chain string, rules []iptables.Rule) error) error {
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
			if name := cstr(tdata); string(name) != "ERROR" {
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
	var rules []iptables.Rule
	var offs []int
	for h, hd := range heads {
		end := len(table)
		if h+1 < len(heads) {
			end = heads[h+1].off
		}
		name := hd.name
		if !iptables.Reads(name) {
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
			return fmt.Errorf("chain %s has no end", clip(name))
		}
		if known(name, chainDigest(table, offs[:len(offs)-1], lay, seed, chainAt), len(offs)-1) {
			continue
		}
		for _, off := range offs[:len(offs)-1] {
			rule, err := decodeLegacyEntry(table, off, lay, fam, chainAt, name)
			if err != nil {
				return fmt.Errorf("chain %s: %w", clip(name), err)
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
	return next, cstr(t[2:31]), t[xtTargetHead:tsize], nil
}

func cstr(b []byte) []byte {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		return b[:i]
	}
	return b
}

// decodeLegacyEntry reads one rule as iptables-legacy-save prints it.
func decodeLegacyEntry(table []byte, off int, lay entryLayout, fam int, chainAt func(int) (string, bool), chain string) (iptables.Rule, error) {
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
		name, ok := protoName(byte(proto))
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
		if err := d.match(cstr(e[m+2:m+31]), e[m+xtTargetHead:m+msize]); err != nil {
			return d.r, err
		}
		m += msize
	}
	next := int(binary.NativeEndian.Uint16(e[lay.nextOffset:]))
	t := e[to:next]
	tsize := int(binary.NativeEndian.Uint16(t))
	tname := cstr(t[2:31])
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

// Fallbacks counts reads that fell back to iptables-legacy-save, and says
// why the last did.
func (r *legacyReader) Fallbacks() (uint64, string) {
	why, _ := r.lastFallback.Load().(string)
	return uint64(r.fallbacks.Load()), why
}
