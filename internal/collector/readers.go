package collector

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/proxyaudit/proxyaudit/audit"
)

// RuleReader reads one node's kube-proxy rules from one source.
type RuleReader interface {
	// Read reads the rules once. A table kube-proxy's rules should be in
	// but that is gone reads as NoRules, not as an error.
	Read(ctx context.Context) (*audit.Observed, error)
	// String names the source for people ("iptables (legacy backend)").
	String() string
}

// Reader returns the reader for src: one `iptables-save -t nat` whose
// output is parsed as it streams (the text is never held whole), kube-
// proxy's nftables table over netlink (or one `nft -j list table ip
// kube-proxy` with NFTJSON), or one netlink dump of the IPVS table.
func (h *Host) Reader(src Source) RuleReader {
	switch {
	case src.Mode == audit.ModeIPVS:
		return &ipvsReader{open: h.OpenIPVS}
	case src.Mode == audit.ModeNFTables && !h.NFTJSON:
		return newNFTNetlinkReader()
	case src.Mode == audit.ModeNFTables:
		return &toolReader{src: src, exec: h, argv: []string{"nft", "-j", "list", "table", "ip", "kube-proxy"}, parse: audit.ParseNFTables}
	case src.Legacy:
		return &toolReader{src: src, exec: h, argv: []string{"iptables-legacy-save", "-t", "nat"}, parse: audit.ParseIPTables}
	default:
		return &toolReader{src: src, exec: h, argv: []string{"iptables-save", "-t", "nat"}, parse: audit.ParseIPTables}
	}
}

var (
	_ RuleReader = (*toolReader)(nil)
	_ RuleReader = (*ipvsReader)(nil)
)

// toolReader runs a dump tool and parses its output as it streams.
type toolReader struct {
	src   Source
	exec  *Host
	argv  []string
	parse func(io.Reader) (*audit.Observed, error)
	bytes atomic.Int64
}

func (r *toolReader) String() string { return r.src.String() }

// Source is where the reader reads from.
func (r *toolReader) Source() Source { return r.src }

// BytesRead is the size of the last dump the tool wrote.
func (r *toolReader) BytesRead() int64 { return r.bytes.Load() }

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
			// The table is gone: kube-proxy's rules were removed.
			return &audit.Observed{Mode: audit.ModeNFTables, NoRules: true, Families: []int{4}}, nil
		}
		return nil, fmt.Errorf("%s: %w: %s", name, werr, strings.TrimSpace(stderr.String()))
	}
	if perr != nil {
		return nil, fmt.Errorf("%s output: %w", name, perr)
	}
	return obs, nil
}

// ipvsReader dumps the kernel's IPVS table: the table `ipvsadm -Sn`
// prints, read without forking a tool. It keeps one handle; reads are
// serialised, and a handle that failed is closed and reopened on the next
// read.
type ipvsReader struct {
	open func() (IPVS, error)
	mu   sync.Mutex
	h    IPVS
}

func (r *ipvsReader) String() string { return string(audit.ModeIPVS) }

// Source is where the reader reads from.
func (r *ipvsReader) Source() Source { return Source{Mode: audit.ModeIPVS} }

func (r *ipvsReader) Read(context.Context) (*audit.Observed, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.h == nil {
		h, err := r.open()
		if err != nil {
			return nil, err
		}
		r.h = h
	}
	vs, err := r.h.VirtualServers()
	if err != nil {
		r.h.Close()
		r.h = nil
		return nil, err
	}
	return audit.FromIPVS(vs), nil
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
