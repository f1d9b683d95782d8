// Package collector is the node side of proxyaudit: it finds out which
// rules kube-proxy programs on this node, reads them through the cheapest
// real source, and streams them to the aggregator.
package collector

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"strings"

	"github.com/coreos/go-iptables/iptables"

	"github.com/proxyaudit/proxyaudit/audit"
)

// Source reads one node's kube-proxy rules.
type Source struct {
	Mode audit.Mode
	// Legacy selects the iptables-legacy backend.
	Legacy bool
}

func (s Source) String() string {
	if s.Mode == audit.ModeIPTables && s.Legacy {
		return "iptables (legacy backend)"
	}
	if s.Mode == audit.ModeIPTables {
		return "iptables (nf_tables backend)"
	}
	return string(s.Mode)
}

// ErrNoKubeProxy means no mode's rules were found: kube-proxy has not
// programmed this node (yet), or runs in a mode proxyaudit cannot read.
var ErrNoKubeProxy = errors.New("no kube-proxy rules found: no kube-ipvs0 interface, no nftables table ip kube-proxy, no KUBE-SERVICES chain in either iptables backend")

// Detect finds the mode kube-proxy programs on this node. IPVS comes first:
// in IPVS mode kube-proxy also keeps an iptables KUBE-SERVICES chain. Each
// check is a small query, never a listing of the whole ruleset, and none
// takes the xtables lock.
func Detect(ctx context.Context) (Source, error) {
	if _, err := net.InterfaceByName("kube-ipvs0"); err == nil {
		return Source{Mode: audit.ModeIPVS}, nil
	}
	if out, err := exec.CommandContext(ctx, "nft", "-j", "list", "chain", "ip", "kube-proxy", "services").Output(); err == nil && bytes.Contains(out, []byte(`"services"`)) {
		return Source{Mode: audit.ModeNFTables}, nil
	}
	var errs []error
	for _, b := range []struct {
		path   string
		legacy bool
	}{{"iptables", false}, {"iptables-legacy", true}} {
		path, err := exec.LookPath(b.path)
		if err != nil {
			continue
		}
		ipt, err := iptables.New(iptables.Path(path))
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", b.path, err))
			continue
		}
		if ok, err := ipt.ChainExists("nat", "KUBE-SERVICES"); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", b.path, err))
		} else if ok {
			return Source{Mode: audit.ModeIPTables, Legacy: b.legacy}, nil
		}
	}
	if len(errs) > 0 {
		return Source{}, fmt.Errorf("%w (%v)", ErrNoKubeProxy, errors.Join(errs...))
	}
	return Source{}, ErrNoKubeProxy
}

// ParseMode turns a --mode value into a Source; "auto" returns ok false.
func ParseMode(mode string) (Source, bool, error) {
	switch mode {
	case "auto", "":
		return Source{}, false, nil
	case "iptables":
		return Source{Mode: audit.ModeIPTables}, true, nil
	case "iptables-legacy":
		return Source{Mode: audit.ModeIPTables, Legacy: true}, true, nil
	case "nftables":
		return Source{Mode: audit.ModeNFTables}, true, nil
	case "ipvs":
		return Source{Mode: audit.ModeIPVS}, true, nil
	}
	return Source{}, false, fmt.Errorf("--mode %q: want auto, iptables, iptables-legacy, nftables or ipvs", mode)
}

// Read reads the rules once: one `iptables-save -t nat` whose output is
// parsed as it streams (the text is never held whole), one `nft -j list
// table ip kube-proxy`, or one netlink dump of the IPVS table.
func (s Source) Read(ctx context.Context) (*audit.Observed, error) {
	if s.Mode == audit.ModeIPVS {
		return readIPVS()
	}
	var argv []string
	parse := audit.ParseIPTables
	switch {
	case s.Mode == audit.ModeIPTables && s.Legacy:
		argv = []string{"iptables-legacy-save", "-t", "nat"}
	case s.Mode == audit.ModeIPTables:
		argv = []string{"iptables-save", "-t", "nat"}
	case s.Mode == audit.ModeNFTables:
		argv, parse = []string{"nft", "-j", "list", "table", "ip", "kube-proxy"}, audit.ParseNFTables
	default:
		return nil, fmt.Errorf("reading %s rules is not supported yet", s.Mode)
	}
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	var stderr bytes.Buffer
	cmd.Stderr = &limitedBuffer{b: &stderr, max: 4096}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: %w", argv[0], err)
	}
	obs, perr := parse(out)
	if perr != nil {
		// Drain so the child is not blocked writing, then reap it.
		_, _ = io.Copy(io.Discard, out)
	}
	werr := cmd.Wait()
	if werr != nil {
		if s.Mode == audit.ModeNFTables && strings.Contains(stderr.String(), "No such file or directory") {
			// The table is gone: kube-proxy's rules were removed.
			return &audit.Observed{Mode: audit.ModeNFTables, NoRules: true, Families: []int{4}}, nil
		}
		return nil, fmt.Errorf("%s: %w: %s", strings.Join(argv, " "), werr, strings.TrimSpace(stderr.String()))
	}
	if perr != nil {
		return nil, fmt.Errorf("%s output: %w", strings.Join(argv, " "), perr)
	}
	return obs, nil
}

type limitedBuffer struct {
	b   *bytes.Buffer
	max int
}

func (l *limitedBuffer) Write(p []byte) (int, error) {
	if room := l.max - l.b.Len(); room > 0 {
		if len(p) > room {
			l.b.Write(p[:room])
		} else {
			l.b.Write(p)
		}
	}
	return len(p), nil
}
