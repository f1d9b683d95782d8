package iptables

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// NFTReader reads iptables-nft's nat tables (table ip nat and table
// ip6 nat, where iptables-nft keeps the rules iptables-save prints)
// straight from the kernel over netlink, and after the first read only
// the chains a commit touched: the change signal's notifications name
// them (NEWRULE, DELRULE, NEWCHAIN, DELCHAIN), and each is dumped again
// on its own. A sync of kube-proxy that rewrote ten services costs their
// chains and its dispatch chains, not the table.
//
// A whole read streams the table's rules through one 64 KiB buffer,
// decoding each into the chain-by-chain model (NAT). Under
// churn a whole dump can be interrupted (the kernel resumes a dump by
// position, so a commit between two parts may skip or repeat rules, and
// flags it NLM_F_DUMP_INTR): it is tried again, and after a few
// interrupted tries read chain by chain (each chain's dump is small). A
// rule the decoder does not understand in a chain the audit reads makes
// that read fall back to iptables-save for the family (counted).
type NFTReader struct {
	mu   sync.Mutex
	fd   int // -1: closed
	bufs [2][]byte
	got  [][]byte
	seq  uint32
	fams [2]*NAT // IPv4, IPv6; nil: no base (the next read is whole)
	// mirrors are the mirrored chains (see chainNotes) of each family,
	// kept up to date from notifications.
	mirrors [2]map[string]*ruleMirror
	// chainRules and chainHandles are readChain's, kept between calls.
	chainRules   []Rule
	chainHandles []uint64
	// text reads one family with iptables-save when the decoder cannot;
	// nil: no tool (the error stands).
	text  func(ctx context.Context, fam int) (*audit.Observed, error)
	notes chainNotes
	bytes atomic.Int64
	// Where reads went: whole netlink reads, chains read again, whole
	// reads done chain by chain after interrupted dumps, and reads that
	// fell back to iptables-save.
	whole, chains, byChain, fallbacks atomic.Int64
	// mirrorOps counts the mirrored chains' notified changes applied.
	mirrorOps    atomic.Int64
	lastFallback atomic.Value // string: why
	// maxDumpParts: see the constant (0 reads chain by chain from the
	// start, as the tests do).
	maxDumpParts int
	// omitChains: the models built leave out endpoint chain names (set
	// by ReadChanges, whose results are streamed).
	omitChains bool
	// peeks spaces the dumps of the dispatch Flushed makes when
	// notifications were lost.
	peeks nl.PeekRate
}

func NewNFTReader(text func(ctx context.Context, fam int) (*audit.Observed, error)) *NFTReader {
	// Sequence numbers start where no other process can guess: an answer
	// must name the request's.
	return &NFTReader{fd: -1, text: text, maxDumpParts: maxDumpParts, seq: rand.Uint32()}
}

func (r *NFTReader) String() string { return "iptables (nf_tables backend, netlink)" }

// Mode is the mode whose rules the reader reads.
func (r *NFTReader) Mode() audit.Mode { return audit.ModeIPTables }

// NFTCounts are what an NFTReader's reads did so far: whole reads,
// chains dumped one by one, whole reads made chain by chain (a dump past
// its part limit), mirrored chains' changes applied from notifications.
type NFTCounts struct{ Whole, Chains, ByChain, MirrorOps int64 }

// Counts returns the reader's counts so far.
func (r *NFTReader) Counts() NFTCounts {
	return NFTCounts{Whole: r.whole.Load(), Chains: r.chains.Load(), ByChain: r.byChain.Load(), MirrorOps: r.mirrorOps.Load()}
}

// CaughtUp says whether the notifications the reader took hold every
// change up to the commit of generation gen, or lost one on the way (see
// nl.Notes.CaughtUp).
func (r *NFTReader) CaughtUp(gen uint64) bool { return r.notes.CaughtUp(gen) }

// SetMaxDumpParts sets how many parts of a whole-table dump a read takes
// before it reads the rest chain by chain (0: no limit); tests lower it
// to exercise both ways.
func (r *NFTReader) SetMaxDumpParts(n int) { r.maxDumpParts = n }

// BytesRead is what the last read received from the kernel.
func (r *NFTReader) BytesRead() int64 { return r.bytes.Load() }

// Note, Lost and Subscribed take the nf_tables notifications the
// collector's change signal receives (its NotificationSink): the chains
// each commit touched, and the mirrored chains' changes.
func (r *NFTReader) Note(typ, flags uint16, data []byte) { r.notes.Note(typ, flags, data) }

// Lost: a notification was dropped; the next read is whole.
func (r *NFTReader) Lost() { r.notes.Lost() }

// Subscribed says whether notifications flow: without them every read
// is whole.
func (r *NFTReader) Subscribed(on bool) { r.notes.Subscribed(on) }

// Read reads both families whole.
func (r *NFTReader) Read(ctx context.Context) (*audit.Observed, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fams = [2]*NAT{}
	r.omitChains = false
	ch, err := r.read(ctx)
	if err != nil {
		return nil, err
	}
	return ch.Whole, nil
}

// ReadChanges reads what changed since the last read.
func (r *NFTReader) ReadChanges(ctx context.Context) (*audit.Changes, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.omitChains = true // what changed is streamed, and the stream carries no endpoint chain names
	return r.read(ctx)
}

func (r *NFTReader) read(ctx context.Context) (*audit.Changes, error) {
	if r.fd < 0 {
		fd, err := nl.OpenNetfilter()
		if err != nil {
			return nil, err
		}
		r.fd = fd
	}
	var n int64
	defer func() { r.bytes.Store(n) }()
	// What was touched up to now; what is touched from here on is read
	// next time.
	touched := r.notes.take()
	whole := false
	var parts []*audit.Observed
	var changed []audit.ObservedFrontend
	var removed []audit.FrontendKey
	for i, fam := range []int{4, 6} {
		t := touched.fams[i]
		base := r.fams[i]
		if base != nil {
			base.OmitEndpointChains = r.omitChains
		}
		if base == nil || touched.lost || t.reset || len(t.chains) > nl.MaxChainReads {
			obs, err := r.readWhole(ctx, i, fam, &n)
			if err != nil {
				return nil, err
			}
			parts = append(parts, obs)
			whole = true
			continue
		}
		again, err := r.readTouched(ctx, i, fam, t, base, &n)
		if again {
			// The next read is whole, and falls back to the tool.
			return r.read(ctx)
		}
		if err != nil {
			return nil, err
		}
		c, rm := base.Changes()
		changed = append(changed, c...)
		removed = append(removed, rm...)
	}
	if whole {
		// A family read whole makes the read whole: the other family's
		// model is built from its table as it stands.
		for i, fam := range []int{4, 6} {
			if len(parts) > i && parts[i].Families[0] == fam {
				continue
			}
			if nat := r.fams[i]; nat != nil {
				nat.OmitEndpointChains = r.omitChains
				o := nat.Observed()
				parts = slices.Insert(parts, i, o)
			}
		}
		obs, err := audit.Merge(parts...)
		if err != nil {
			r.fams = [2]*NAT{}
			return nil, err
		}
		r.rebase()
		return &audit.Changes{Whole: obs}, nil
	}
	r.rebase()
	slices.SortFunc(changed, func(a, b audit.ObservedFrontend) int { return a.FrontendKey.Compare(b.FrontendKey) })
	slices.SortFunc(removed, audit.FrontendKey.Compare)
	total := 0
	for _, nat := range r.fams {
		total += nat.Len()
	}
	return &audit.Changes{Through: touched.through, Frontends: changed, Removed: removed, NoRules: total == 0, Families: []int{4, 6}, Mode: audit.ModeIPTables}, nil
}

// rebase tells the notes how many rules each family's KUBE-SERVICES
// holds as read (see flushWatch).
func (r *NFTReader) rebase() {
	for i := range r.mirrors {
		n := 0
		if m := r.mirrors[i]["KUBE-SERVICES"]; m != nil {
			n = len(m.nodes)
		}
		r.notes.Rebase(i, n)
	}
}

// dispatchEmpty says whether family fam's dispatch chains hold no rule
// (or are gone). The chains are dumped on the reader's socket, uncounted
// and undecoded (KUBE-SERVICES at 10k services: ~65 ms, nothing once
// flushed): a dump left unread would need its socket closed, and closing
// an nf_tables socket waits for the kernel to free what the commits
// before it deleted (a minute and more was seen after a flush at 2,500
// services under churn).
func (r *NFTReader) dispatchEmpty(ctx context.Context, fam int) bool {
	if r.fd < 0 {
		fd, err := nl.OpenNetfilter()
		if err != nil {
			return false
		}
		r.fd = fd
	}
	for _, chain := range []string{"KUBE-SERVICES", "KUBE-NODEPORTS"} {
		rules := 0
		var n int64
		_, err := r.dump(ctx, unix.NFT_MSG_GETRULE, fam,
			append(nl.Attr(unix.NFTA_RULE_TABLE, nl.CString("nat")), nl.Attr(unix.NFTA_RULE_CHAIN, nl.CString(chain))...), &n, 0,
			func([]byte) error { rules++; return nil })
		if err != nil && !errors.Is(err, unix.ENOENT) {
			r.closeOnError(err)
			return false
		}
		if rules > 0 {
			return false
		}
	}
	return true
}

// Flushed: a commit since the last read emptied KUBE-SERVICES (or cut it
// to half) in a family that had services, or deleted its nat table; or,
// when notifications were lost since, KUBE-SERVICES holds no rule now.
func (r *NFTReader) Flushed(ctx context.Context) bool {
	tripped, incomplete := r.notes.Flushed()
	if tripped || !incomplete {
		return tripped
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, fam := range []int{4, 6} {
		if r.fams[i] != nil && r.fams[i].Len() > 0 && r.peeks.Allow(time.Now()) && r.dispatchEmpty(ctx, fam) {
			return true
		}
	}
	return false
}

// readWhole dumps family fam's table (the i-th) whole, mirroring its
// chains afresh; a rule the decoder cannot read falls back to the text
// tool (and leaves no base: the next read is whole again).
//
// A table that had frontends and whose dispatch chains (KUBE-SERVICES,
// KUBE-NODEPORTS: every frontend is one of their rules) now hold no rule
// has no frontend, whatever its other chains hold: it is not read (a
// flush is reported at once even where a whole read of the rest would
// take seconds), and leaves no base, so the next read is whole.
func (r *NFTReader) readWhole(ctx context.Context, i, fam int, n *int64) (*audit.Observed, error) {
	had := r.fams[i] != nil && r.fams[i].Len() > 0
	r.mirrors[i] = map[string]*ruleMirror{}
	if had && r.dispatchEmpty(ctx, fam) {
		r.fams[i] = nil
		r.whole.Add(1)
		return &audit.Observed{Mode: audit.ModeIPTables, Families: []int{fam}, NoRules: true}, nil
	}
	nat, err := r.readTable(ctx, fam, r.mirrors[i], n)
	var obs *audit.Observed
	switch {
	case errors.Is(err, ErrUndecodable) && r.text != nil:
		r.fallbacks.Add(1)
		r.lastFallback.Store(err.Error())
		obs, err = r.text(ctx, fam)
		if err != nil {
			r.fams = [2]*NAT{}
			return nil, fmt.Errorf("IPv%d rules: the netlink read failed (%v) and so did the fallback: %w", fam, errors.Unwrap(err), err)
		}
		nat = nil
	case err != nil:
		r.fams = [2]*NAT{}
		r.closeOnError(err)
		return nil, fmt.Errorf("read table %s nat over netlink: %w", nl.FamilyName(fam), err)
	default:
		nat.OmitEndpointChains = r.omitChains
		fs, _ := nat.Changes()
		obs = &audit.Observed{Mode: audit.ModeIPTables, Families: []int{fam}, Frontends: fs, NoRules: len(fs) == 0}
	}
	r.fams[i] = nat
	return obs, nil
}

// readTouched brings family fam's base (the i-th) up to date with what
// was touched: the mirrored chains' notified changes, applied; a chain
// whose changes do not apply (a rule inserted after one the mirror does
// not hold, a rule that did not decode) is dumped instead, as is every
// other touched chain. again: a chain did not decode, the base is gone,
// and the read must be made again (whole).
func (r *NFTReader) readTouched(ctx context.Context, i, fam int, t famNotes, base *NAT, n *int64) (again bool, err error) {
	chains := t.chains
	if r.mirrors[i] == nil {
		r.mirrors[i] = map[string]*ruleMirror{}
	}
	r.mirrorOps.Add(int64(len(t.ops)))
	for chain, m := range applyOps(r.mirrors[i], t.ops) {
		if m == nil {
			if chains == nil {
				chains = map[string]struct{}{}
			}
			chains[chain] = struct{}{}
			continue
		}
		if err := base.SetChain(chain, m.rules()); err != nil {
			r.fams = [2]*NAT{}
			return false, err
		}
	}
	for chain := range chains {
		rules, handles, ok, err := r.readChain(ctx, fam, chain, n)
		if err != nil {
			r.fams = [2]*NAT{}
			r.closeOnError(err)
			if errors.Is(err, ErrUndecodable) {
				return true, err
			}
			return false, fmt.Errorf("read chain %s of table %s nat over netlink: %w", nl.Clip(chain), nl.FamilyName(fam), err)
		}
		r.chains.Add(1)
		if mirrored(chain) {
			if ok {
				r.mirrors[i][chain] = mirrorOf(rules, handles)
			} else {
				delete(r.mirrors[i], chain)
			}
		}
		if !ok {
			base.DeleteChain(chain)
			continue
		}
		if err := base.SetChain(chain, rules); err != nil {
			r.fams = [2]*NAT{}
			return false, err
		}
	}
	return false, nil
}

// closeOnError drops a socket that may hold part of a dump.
func (r *NFTReader) closeOnError(err error) {
	if r.fd >= 0 && !errors.Is(err, ErrUndecodable) {
		unix.Close(r.fd)
		r.fd = -1
	}
}

// maxDumpParts is how many parts of a whole-table dump a read takes
// before it reads the rest chain by chain. The kernel resumes each 32 KiB
// part of a dump by walking the table from its start, so part k costs k
// parts' walk: one dump of a large table costs the square of its size
// (61, 124 and 481 ms of system time at 500, 1,000 and 2,000 services;
// about ten seconds at 10k), while a dump per chain costs ~10 µs of kernel
// time a chain whatever the size. Part 200 walks ~20k rules, about what
// its ~35 chains cost one by one. A small table (or one just flushed) is
// read in one request.
const maxDumpParts = 200

// errDumpStopped: a dump stopped before its end, at its part limit.
var errDumpStopped = errors.New("the dump stopped at its part limit")

// readTable reads one family's nat table whole into a new model: its
// rules in one dump, and from where that dump reached maxDumpParts chain
// by chain, in the order of the table's chain list. A table that does not
// exist reads as an empty one.
func (r *NFTReader) readTable(ctx context.Context, fam int, mirrors map[string]*ruleMirror, n *int64) (*NAT, error) {
	nat, last := NewNAT(fam), ""
	stopped := false
	for try := 0; r.maxDumpParts > 0 && try < nl.InterruptedTries; try++ {
		clear(mirrors)
		whole, at, intr, err := r.dumpTable(ctx, fam, mirrors, n, r.maxDumpParts)
		if errors.Is(err, errDumpStopped) {
			// The rest of the dump is not read: a new socket for what
			// follows.
			unix.Close(r.fd)
			if r.fd, err = nl.OpenNetfilter(); err != nil {
				return nil, err
			}
			if intr {
				continue
			}
			// The chains before the one the dump stopped in are whole.
			nat, last, stopped = whole, at, true
			break
		}
		if err != nil || !intr {
			r.whole.Add(1)
			return whole, err
		}
	}
	var order []string // every chain, in the table's order (a dump's)
	for try := 0; ; try++ {
		order = order[:0]
		intr, err := r.dump(ctx, unix.NFT_MSG_GETCHAIN, fam, nl.Attr(unix.NFTA_CHAIN_TABLE, nl.CString("nat")), n, 0, func(body []byte) error {
			if table, name := nl.ChainOf(body); table == "nat" {
				order = append(order, name)
			}
			return nil
		})
		if errors.Is(err, unix.ENOENT) {
			return NewNAT(fam), nil
		}
		if err != nil {
			return nil, err
		}
		if !intr {
			break
		}
		if try == 10 {
			return nil, errors.New("the chain list was interrupted by commits ten times in a row")
		}
	}
	from := 0
	if i := slices.Index(order, last); stopped && i >= 0 {
		from = i
	} else {
		clear(mirrors)
		nat = NewNAT(fam)
	}
	r.byChain.Add(1)
	// Chain by chain; a commit during the read touches chains the next
	// read reads again.
	for _, name := range order[from:] {
		if !Reads(name) {
			continue
		}
		rules, handles, ok, err := r.readChain(ctx, fam, name, n)
		if err != nil {
			return nil, err
		}
		if ok {
			if mirrored(name) {
				mirrors[name] = mirrorOf(rules, handles)
			}
			if err := nat.SetChain(name, rules); err != nil {
				return nil, err
			}
		}
	}
	return nat, nil
}

// Fallbacks counts reads that fell back to iptables-save, and says why
// the last did.
func (r *NFTReader) Fallbacks() (uint64, string) {
	why, _ := r.lastFallback.Load().(string)
	return uint64(r.fallbacks.Load()), why
}
