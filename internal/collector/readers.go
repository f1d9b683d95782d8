package collector

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	utilexec "k8s.io/utils/exec"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/cilium"
	"github.com/proxyaudit/proxyaudit/dataplane/iptables"
	"github.com/proxyaudit/proxyaudit/dataplane/ipvs"
	"github.com/proxyaudit/proxyaudit/dataplane/nftables"
	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// RuleReader reads one node's kube-proxy rules from one source.
type RuleReader interface {
	// Read reads the rules once. A table kube-proxy's rules should be in
	// but that is gone reads as NoRules, not as an error.
	Read(ctx context.Context) (*audit.Observed, error)
	// String names the source for people ("iptables (legacy backend)").
	String() string
}

// ChangeReader is a RuleReader that can say what changed since its last
// read instead of returning every frontend: a node whose kube-proxy
// rewrote ten services reports those.
type ChangeReader interface {
	RuleReader
	// ReadChanges reads the rules and returns what changed since the
	// last Read or ReadChanges that returned no error (a whole read at
	// the first, and whenever the reader cannot vouch for the changes).
	ReadChanges(ctx context.Context) (*audit.Changes, error)
}

// NoEndpointReader is a RuleReader that also names the frontends its
// last read found rejected or dropped for having no endpoints (nftables'
// no-endpoint-services map): a service scaled to zero, whose UDP flows
// kube-proxy leaves pinned to the gone pods. Their conntrack flows are
// counted even by a collector that never saw the service with endpoints.
type NoEndpointReader interface {
	NoEndpoints() []audit.FrontendKey
}

// sourceOf says which source r reads: the collector's own readers name
// it, a mode's reader in its dataplane package names its mode (and the
// iptables backend, Legacy).
func sourceOf(r RuleReader) (Source, bool) {
	switch r := r.(type) {
	case interface{ Source() Source }:
		return r.Source(), true
	case interface{ Mode() audit.Mode }:
		src := Source{Mode: r.Mode()}
		if l, ok := r.(interface{ Legacy() bool }); ok {
			src.Legacy = l.Legacy()
		}
		return src, true
	}
	return Source{}, false
}

// Reader returns the reader for src, reading both IP families (kube-proxy
// programs both wherever the kernel has IPv6, even on a single-stack
// node): iptables-nft's ip and ip6 nat tables over netlink, and then only
// the chains a commit touched; the legacy backend's nat tables with the
// getsockopt iptables-legacy-save uses, decoded in place (with
// IPTablesSave, or for a rule the decoders cannot read, `iptables-save -t
// nat` and `ip6tables-save -t nat`, or their -legacy tools, each parsed as
// it streams); kube-proxy's ip and ip6 nftables tables over
// netlink (or `nft -j list table ip|ip6 kube-proxy` with NFTJSON); or one
// netlink dump of the IPVS table, which holds both.
func (h *Host) Reader(src Source) RuleReader {
	switch {
	case src.Mode == audit.ModeIPVS:
		return &ipvsReader{open: h.OpenIPVS}
	case src.Mode == audit.ModeCilium:
		return &ciliumReader{bpffs: h.BPFFS, read: h.ReadCilium, note: src.Note}
	case src.Mode == audit.ModeNFTables && !h.NFTJSON:
		return nftables.NewNetlinkReader()
	case src.Mode == audit.ModeNFTables:
		return h.familyReaders(src, func(fam int) []string {
			return []string{"nft", "-j", "list", "table", nl.FamilyName(fam), "kube-proxy"}
		})
	case src.Mode == audit.ModeIPTables && !h.IPTablesSave:
		text := h.iptablesSave(src)
		fallback := func(ctx context.Context, fam int) (*audit.Observed, error) { return text.fams[fam/6].Read(ctx) }
		if src.Legacy {
			return iptables.NewLegacyReader(fallback)
		}
		return iptables.NewNFTReader(fallback)
	default:
		return h.iptablesSave(src)
	}
}

// iptablesSave reads both families' nat tables with iptables-save and
// ip6tables-save (or their -legacy tools).
func (h *Host) iptablesSave(src Source) *familyReader {
	return h.familyReaders(src, func(fam int) []string {
		tool := map[int]string{4: "iptables", 6: "ip6tables"}[fam]
		if src.Legacy {
			tool += "-legacy"
		}
		return []string{tool + "-save", "-t", "nat"}
	})
}

func (h *Host) familyReaders(src Source, argv func(fam int) []string) *familyReader {
	r := &familyReader{src: src}
	for _, fam := range []int{4, 6} {
		tr := &toolReader{src: src, exec: h, argv: argv(fam), fam: fam}
		r.fams = append(r.fams, tr)
	}
	return r
}

var (
	_ RuleReader = (*toolReader)(nil)
	_ RuleReader = (*familyReader)(nil)
	_ RuleReader = (*ipvsReader)(nil)
	_ RuleReader = (*ciliumReader)(nil)
)

// familyReader reads each family's rules with its own tool run and merges
// them. A host whose tools cannot read IPv6 at all (no ip6tables binary)
// is read in IPv4 only, with a warning: the aggregator then reports its
// IPv6 half as not audited.
type familyReader struct {
	src  Source
	fams []*toolReader
}

func (r *familyReader) String() string { return r.src.String() }

// Source is where the reader reads from.
func (r *familyReader) Source() Source { return r.src }

// BytesRead is the size of the last dumps the tools wrote.
func (r *familyReader) BytesRead() int64 {
	var n int64
	for _, f := range r.fams {
		n += f.bytes.Load()
	}
	return n
}

func (r *familyReader) Read(ctx context.Context) (*audit.Observed, error) {
	parts := make([]*audit.Observed, 0, len(r.fams))
	var warnings []string
	for _, f := range r.fams {
		obs, err := f.Read(ctx)
		if f.fam != 4 && errors.Is(err, utilexec.ErrExecutableNotFound) {
			warnings = append(warnings, fmt.Sprintf("IPv%d rules not read: %s is not installed", f.fam, f.argv[0]))
			continue
		}
		if err != nil {
			return nil, err
		}
		parts = append(parts, obs)
	}
	obs, err := audit.Merge(parts...)
	if err != nil {
		return nil, err
	}
	obs.Warnings = append(obs.Warnings, warnings...)
	return obs, nil
}

// toolReader runs a dump tool for one IP family and parses its output as
// it streams.
type toolReader struct {
	src   Source
	exec  *Host
	argv  []string
	fam   int
	bytes atomic.Int64
}

func (r *toolReader) String() string { return r.src.String() }

// Source is where the reader reads from.
func (r *toolReader) Source() Source { return r.src }

func (r *toolReader) parse(in io.Reader) (*audit.Observed, error) {
	if r.src.Mode == audit.ModeNFTables {
		return nftables.Parse(in)
	}
	return iptables.ParseFamily(in, r.fam)
}

func (r *toolReader) Read(ctx context.Context) (*audit.Observed, error) {
	cmd := r.exec.Exec.CommandContext(ctx, r.argv[0], r.argv[1:]...)
	name := strings.Join(r.argv, " ")
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	errPipe, err := cmd.StderrPipe()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: %w", r.argv[0], err)
	}
	// The tool's complaint, kept to 4 KiB, read beside its output so that
	// neither pipe can fill and block it.
	var stderr bytes.Buffer
	var wg sync.WaitGroup
	wg.Go(func() {
		io.Copy(&stderr, io.LimitReader(errPipe, 4096))
		io.Copy(io.Discard, errPipe)
	})
	counted := &countingReader{r: out}
	obs, perr := r.parse(counted)
	// Drain what the parser left (all of it after an error) so the child
	// is not blocked writing, then reap it.
	io.Copy(io.Discard, counted)
	r.bytes.Store(counted.n)
	wg.Wait()
	if werr := cmd.Wait(); werr != nil {
		if r.src.Mode == audit.ModeNFTables && strings.Contains(stderr.String(), "No such file or directory") {
			// The table is gone: kube-proxy's rules of this family were
			// removed. Read, and empty (no reject map either).
			return &audit.Observed{Mode: audit.ModeNFTables, NoRules: true, RejectsKnown: true, Families: []int{r.fam}}, nil
		}
		return nil, fmt.Errorf("%s: %w: %s", name, werr, strings.TrimSpace(stderr.String()))
	}
	if perr != nil {
		return nil, fmt.Errorf("%s output: %w", name, perr)
	}
	if r.src.Mode == audit.ModeNFTables && !slices.Equal(obs.Families, []int{r.fam}) {
		return nil, fmt.Errorf("%s printed the rules of IPv%v, not of IPv%d", name, obs.Families, r.fam)
	}
	return obs, nil
}

// ipvsReader dumps the kernel's IPVS table: the table `ipvsadm -Sn`
// prints, read without forking a tool. It keeps one handle; reads are
// serialised, and a handle that failed is closed and reopened on the next
// read.
type ipvsReader struct {
	open func() (ipvs.Table, error)
	mu   sync.Mutex
	h    ipvs.Table
	// had: the last read found virtual servers (see Flushed).
	had bool
}

// ipvsPeeker is an IPVS table that can say cheaply whether it holds any
// virtual server (genlIPVS: the first part of a dump).
type ipvsPeeker interface {
	AnyVirtualServer() (bool, error)
}

// Flushed: the last read found virtual servers and the table now holds
// none (`ipvsadm -C`).
func (r *ipvsReader) Flushed(context.Context) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	p, ok := r.h.(ipvsPeeker)
	if !r.had || !ok {
		return false
	}
	any, err := p.AnyVirtualServer()
	return err == nil && !any
}

func (r *ipvsReader) String() string { return string(audit.ModeIPVS) }

// Source is where the reader reads from.
func (r *ipvsReader) Source() Source { return Source{Mode: audit.ModeIPVS} }

func (r *ipvsReader) Read(ctx context.Context) (*audit.Observed, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.h == nil {
		h, err := r.open()
		if err != nil {
			return nil, err
		}
		r.h = h
	}
	// A read walks the virtual servers one by one (a request each: seconds
	// at 10k); a table cleared meanwhile stops it, and reads as the empty
	// table it now is.
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var cleared atomic.Bool
	if p, ok := r.h.(ipvsPeeker); ok && r.had {
		done := make(chan struct{})
		defer close(done)
		go func() {
			t := time.NewTicker(flushPoll)
			defer t.Stop()
			for {
				select {
				case <-done:
					return
				case <-t.C:
				}
				if any, err := p.AnyVirtualServer(); err == nil && !any {
					cleared.Store(true)
					cancel()
					return
				}
			}
		}()
	}
	vs, err := r.h.VirtualServers(rctx)
	if cleared.Load() {
		r.had = false
		return ipvs.Observed(nil), nil
	}
	if err != nil {
		r.h.Close()
		r.h = nil
		return nil, err
	}
	r.had = len(vs) > 0
	return ipvs.Observed(vs), nil
}

type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// ciliumReader reads Cilium's LB maps (its kube-proxy replacement):
// every read is whole (the maps have no generation to watch), and opens
// the pinned maps read-only afresh, so that an agent restart that
// re-creates them is followed.
type ciliumReader struct {
	bpffs string
	read  func(bpffs string) ([]cilium.MapDump, error)
	bytes atomic.Int64
	// note is detection's (Source.Note), a warning with every read.
	note string
}

// BytesRead is the size of the entries the last read took from the maps.
func (r *ciliumReader) BytesRead() int64 { return r.bytes.Load() }

func (r *ciliumReader) String() string { return string(audit.ModeCilium) }

// Source is where the reader reads from.
func (r *ciliumReader) Source() Source { return Source{Mode: audit.ModeCilium, Note: r.note} }

func (r *ciliumReader) Read(context.Context) (*audit.Observed, error) {
	dumps, err := r.read(r.bpffs)
	if err != nil {
		return nil, err
	}
	var n int64
	for _, d := range dumps {
		n += int64(len(d.Packed) + len(d.Entries)*(d.KeySize+d.ValueSize))
	}
	r.bytes.Store(n)
	lb, err := cilium.Decode(dumps)
	if err != nil {
		return nil, err
	}
	obs := lb.Observed()
	if r.note != "" {
		obs.Warnings = append(obs.Warnings, r.note)
	}
	return obs, nil
}
