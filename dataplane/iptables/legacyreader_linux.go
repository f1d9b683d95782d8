package iptables

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/audit"
)

// LegacyReader reads the legacy (x_tables) backend's nat tables without
// running a tool: one IPT_SO_GET_ENTRIES (IP6T_SO_GET_ENTRIES for IPv6)
// per family, the getsockopt iptables-legacy-save itself uses, decoded in
// place. The kernel hands the whole table over at once (there is no
// partial read), so each read decodes every entry, but only chains whose
// decoded rules changed since the last read go into the model, and only
// the frontends they touch are reported.
//
// A rule the decoder does not understand in a chain the audit reads makes
// that read fall back to iptables-legacy-save (counted), as on nf_tables.
type LegacyReader struct {
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
	// omitChains: see NFTReader.
	omitChains bool
}

// legacyFamily is one family's model and what each chain held at the
// last read (a digest of its entries, by a hash of its name).
type legacyFamily struct {
	nat  *NAT
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

func NewLegacyReader(text func(ctx context.Context, fam int) (*audit.Observed, error)) *LegacyReader {
	return &LegacyReader{fds: [2]int{-1, -1}, text: text, seed: maphash.MakeSeed()}
}

func (r *LegacyReader) String() string { return "iptables (legacy backend, getsockopt)" }

// Mode is the mode whose rules the reader reads.
func (r *LegacyReader) Mode() audit.Mode { return audit.ModeIPTables }

// Legacy: the reader reads the legacy (x_tables) backend.
func (r *LegacyReader) Legacy() bool { return true }

// LegacyCounts are what a LegacyReader's reads did so far: reads, and
// chains decoded that changed.
type LegacyCounts struct{ Reads, Chains int64 }

// Counts returns the reader's counts so far.
func (r *LegacyReader) Counts() LegacyCounts {
	return LegacyCounts{Reads: r.reads.Load(), Chains: r.chains.Load()}
}

// BytesRead is the size of the tables the last read received.
func (r *LegacyReader) BytesRead() int64 { return r.bytes.Load() }

// Read reads both families whole.
func (r *LegacyReader) Read(ctx context.Context) (*audit.Observed, error) {
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
func (r *LegacyReader) ReadChanges(ctx context.Context) (*audit.Changes, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.omitChains = true // streamed: the stream carries no endpoint chain names
	return r.read(ctx)
}

func (r *LegacyReader) read(ctx context.Context) (*audit.Changes, error) {
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
			f = &legacyFamily{nat: NewNAT(fam), sums: map[uint64]chainSum{}}
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
		return &audit.Changes{Whole: obs}, nil
	}
	sort.Slice(changed, func(a, b int) bool { return changed[a].FrontendKey.Compare(changed[b].FrontendKey) < 0 })
	sort.Slice(removed, func(a, b int) bool { return removed[a].Compare(removed[b]) < 0 })
	return &audit.Changes{Frontends: changed, Removed: removed, Families: []int{4, 6}, Mode: audit.ModeIPTables,
		NoRules: r.fams[0].nat.Len()+r.fams[1].nat.Len() == 0}, nil
}

// x_tables getsockopt numbers and the layouts of struct ipt_entry and
// struct ip6t_entry (linux/netfilter_ipv{4,6}/ip{,6}_tables.h; checked
// against the headers with offsetof on amd64).
const (
	iptSoGetEntries = 65 // IPT_SO_GET_ENTRIES = IP6T_SO_GET_ENTRIES
	getEntriesHead  = 40 // struct ipt_get_entries without its entries
)

// readFamily reads one family's nat table and puts the chains whose rules
// changed into f. A kernel without the table (no legacy nat in this
// namespace) reads as an empty one.
func (r *LegacyReader) readFamily(ctx context.Context, fam int, f *legacyFamily, n *int64) error {
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
			return r.apply(f, nil, fam)
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
		err = r.apply(f, buf[getEntriesHead:getEntriesHead+int(info.Size)], fam)
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
func (r *LegacyReader) Flushed(context.Context) bool {
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
func (r *LegacyReader) apply(f *legacyFamily, table []byte, fam int) error {
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
	err := DecodeLegacy(table, fam, r.seed, known, func(chain string, rules []Rule) error {
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

// Fallbacks counts reads that fell back to iptables-legacy-save, and says
// why the last did.
func (r *LegacyReader) Fallbacks() (uint64, string) {
	why, _ := r.lastFallback.Load().(string)
	return uint64(r.fallbacks.Load()), why
}
