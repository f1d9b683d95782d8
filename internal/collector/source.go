// Package collector is the node side of proxyaudit: it finds out which
// rules kube-proxy programs on this node, reads them through the cheapest
// real source, and streams them to the aggregator.
//
// The kernel and the tools are reached only through Host's narrow
// interfaces (a command runner, iptables chain checks, the IPVS table),
// with fakes in collectortest: mode detection and every reader's handling
// of what the kernel says run without root.
package collector

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"

	utilexec "k8s.io/utils/exec"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/cilium"
	"github.com/proxyaudit/proxyaudit/dataplane/iptables"
	"github.com/proxyaudit/proxyaudit/dataplane/ipvs"
	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// Source names where one node's kube-proxy rules are read from.
type Source struct {
	Mode audit.Mode
	// Legacy selects the iptables-legacy backend.
	Legacy bool
	// Note is how detection chose, when the node's state was ambiguous:
	// reported with every read as a node warning.
	Note string
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
	case "cilium":
		return Source{Mode: audit.ModeCilium}, true, nil
	}
	return Source{}, false, fmt.Errorf("--mode %q: want auto, iptables, iptables-legacy, nftables, ipvs or cilium", mode)
}

// IPTables checks iptables chains through one backend's binary
// (go-iptables in production). It never lists a whole table.
type IPTables interface {
	ChainExists(table, chain string) (bool, error)
}

// ChangeSignal tells the collector when kube-proxy's rules may have
// changed, so that a quiet node is not read at all.
type ChangeSignal interface {
	// Token is a cheap summary of the rules' source that changes whenever
	// the rules may have (the nf_tables generation; the legacy table's
	// size and entry count).
	Token() (uint64, error)
	// Events, when not nil, fires soon after the kernel announces a
	// change (or lost announcements), coalesced; the caller then compares
	// tokens.
	Events() <-chan struct{}
	// Lost counts announcements the kernel dropped (a full socket buffer).
	Lost() uint64
	// Exact says an unchanged token proves the rules unchanged (the
	// nf_tables generation); the backstop read is then only a guard
	// against the unforeseen, every exactBackstop × FullReadInterval.
	Exact() bool
	Close()
}

// NotificationSink takes the nf_tables notifications the change signal
// receives anyway (nl.Sink): the netlink readers learn from them which
// maps and chains each commit touched.
type NotificationSink = nl.Sink

// Host is this node's kernel and tools as the collector reaches them.
// NewHost wires the real ones; tests put fakes in the fields.
type Host struct {
	// Exec runs iptables-save, iptables-legacy-save and nft.
	Exec utilexec.Interface
	// IPTables opens chain checks on the nf_tables (false) or legacy
	// (true) backend; an error means that backend's binary is missing.
	IPTables func(legacy bool) (IPTables, error)
	// IP6Tables is IPTables for ip6tables; nil skips IPv6 in detection.
	IP6Tables func(legacy bool) (IPTables, error)
	// OpenIPVS opens the IPVS table.
	OpenIPVS func() (ipvs.Table, error)
	// HasInterface says whether a network interface exists.
	HasInterface func(name string) bool
	// OpenSignal opens the change signal of a source; nil (and no error)
	// when the source has none (IPVS).
	OpenSignal func(src Source) (ChangeSignal, error)
	// NotifyBuffer is the receive buffer of the nf_tables notification
	// subscription in bytes (0: the kernel's default).
	NotifyBuffer int
	// NFTJSON reads nftables mode with `nft -j list table ip kube-proxy`
	// instead of netlink (the fallback for a kernel the netlink reader
	// cannot decode).
	NFTJSON bool
	// IPTablesSave reads iptables-nft with `iptables-save -t nat` instead
	// of netlink.
	IPTablesSave bool
	// NFTChain asks nf_tables whether a chain exists, for detection on a
	// host without the nft binary; nil: not asked.
	NFTChain func(fam int, table, chain string) (bool, error)
	// BPFFS is the BPF filesystem Cilium pins its maps to (cilium-agent
	// --bpf-root; /sys/fs/bpf).
	BPFFS string
	// ReadCilium reads Cilium's LB maps pinned under BPFFS (cilium.Read
	// in production); nil: Cilium is never looked for.
	ReadCilium func(bpffs string) ([]cilium.MapDump, error)
	// KubeProxyAnswers says whether kube-proxy runs on the node (its
	// metrics answer), asked only when both kube-proxy's rules and
	// Cilium's maps are found; nil: not asked (kube-proxy's rules win).
	KubeProxyAnswers func(ctx context.Context) bool
}

// DefaultBPFFS is where Cilium's agent pins its maps by default.
const DefaultBPFFS = "/sys/fs/bpf"

// NewHost returns the real host: tools from PATH, go-iptables, moby/ipvs,
// the kernel's interfaces.
func NewHost() *Host {
	h := &Host{
		NotifyBuffer: DefaultNotifyBuffer,
		Exec:         utilexec.New(),
		IPTables:     func(legacy bool) (IPTables, error) { return openIPTables(legacy, false) },
		IP6Tables:    func(legacy bool) (IPTables, error) { return openIPTables(legacy, true) },
		OpenIPVS:     ipvs.Open,
		NFTChain:     iptables.NFTChainExists,
		BPFFS:        DefaultBPFFS,
		ReadCilium:   cilium.Read,
		HasInterface: func(name string) bool {
			_, err := net.InterfaceByName(name)
			return err == nil
		},
	}
	h.OpenSignal = func(src Source) (ChangeSignal, error) { return openSignal(src, h.NotifyBuffer) }
	return h
}

// DefaultNotifyBuffer: one kube-proxy commit at 10k services announces
// tens of thousands of objects (every new map element); room for such a
// burst while the watcher catches up. The kernel charges it to the
// collector's cgroup only while notifications wait to be read.
const DefaultNotifyBuffer = 16 << 20

// ErrNoKubeProxy means no mode's rules were found: kube-proxy has not
// programmed this node (yet), runs in a mode proxyaudit cannot read, or
// Cilium replaces it and its maps are not where the collector looks.
var ErrNoKubeProxy = errors.New("no kube-proxy rules found: no kube-ipvs0 interface, no nftables table ip or ip6 kube-proxy, no KUBE-SERVICES chain in either iptables backend of either family, and no Cilium service map pinned under the BPF filesystem (where Cilium replaces kube-proxy, mount the node's BPF filesystem into the collector: the chart's cilium.enabled)")

// Detect finds the mode kube-proxy programs on this node, in this order:
// IPVS (a kube-ipvs0 interface; in IPVS mode kube-proxy also keeps an
// iptables KUBE-SERVICES chain), nftables (its services chain), then
// KUBE-SERVICES in the nf_tables iptables backend and in the legacy one;
// IPv4 first, then the same in IPv6 (kube-proxy keeps both families'
// chains wherever the kernel has IPv6, even on an IPv6-only node, so the
// IPv6 checks matter only where it programs IPv6 alone); then, where no
// kube-proxy rules are found, Cilium's service maps pinned under BPFFS
// (its kube-proxy replacement: the maps also exist where Cilium runs
// beside kube-proxy, which then does the services). Where both are found
// and kube-proxy is not running (KubeProxyAnswers), the kube-proxy rules
// are a migration's leftovers and Cilium's maps are audited, with a Note
// saying so. Each check is a
// small query, never a listing of the whole ruleset, and none takes the
// xtables lock.
func (h *Host) Detect(ctx context.Context) (Source, error) {
	src, err := h.detectKubeProxy(ctx)
	if err != nil && h.ciliumPinned() {
		return Source{Mode: audit.ModeCilium}, nil
	}
	if err == nil && h.KubeProxyAnswers != nil && h.ciliumPinned() && !h.KubeProxyAnswers(ctx) {
		// A node migrated to Cilium's kube-proxy replacement whose old
		// kube-proxy rules were never flushed: nothing maintains them, and
		// auditing them would report every change as drift.
		flag := string(src.Mode)
		if src.Legacy {
			flag = "iptables-legacy"
		}
		return Source{Mode: audit.ModeCilium, Note: fmt.Sprintf("kube-proxy's %s rules remain on this node but kube-proxy is not running (nothing listens at its metrics address): "+
			"Cilium's service maps are audited; flush the leftover rules as Cilium's kube-proxy migration guide says, "+
			"or run the collector with --mode %s if kube-proxy serves this node", src.Mode, flag)}, nil
	}
	return src, err
}

// ciliumPinned says whether Cilium's service maps are pinned under BPFFS.
func (h *Host) ciliumPinned() bool {
	if h.ReadCilium == nil {
		return false
	}
	for _, m := range []string{cilium.Services4, cilium.Services6} {
		if _, err := os.Stat(filepath.Join(h.BPFFS, cilium.Globals, m)); err == nil {
			return true
		}
	}
	return false
}

// detectKubeProxy finds kube-proxy's rules: IPVS, nftables, iptables (the
// nf_tables backend, then legacy), in that order.
func (h *Host) detectKubeProxy(ctx context.Context) (Source, error) {
	if h.HasInterface("kube-ipvs0") {
		return Source{Mode: audit.ModeIPVS}, nil
	}
	var errs []error
	for _, fam := range []struct {
		nft, ipt string
		open     func(legacy bool) (IPTables, error)
	}{{"ip", "iptables", h.IPTables}, {"ip6", "ip6tables", h.IP6Tables}} {
		if fam.open == nil {
			continue
		}
		out, err := h.Exec.CommandContext(ctx, "nft", "-j", "list", "chain", fam.nft, "kube-proxy", "services").Output()
		if err == nil && bytes.Contains(out, []byte(`"services"`)) {
			return Source{Mode: audit.ModeNFTables}, nil
		}
		if errors.Is(err, utilexec.ErrExecutableNotFound) && h.NFTChain != nil {
			// No nft binary: ask nf_tables itself.
			if ok, err := h.NFTChain(map[string]int{"ip": 4, "ip6": 6}[fam.nft], "kube-proxy", "services"); err != nil {
				errs = append(errs, err)
			} else if ok {
				return Source{Mode: audit.ModeNFTables}, nil
			}
		}
		for _, legacy := range []bool{false, true} {
			name := fam.ipt
			if legacy {
				name += "-legacy"
			}
			ipt, err := fam.open(legacy)
			if errors.Is(err, utilexec.ErrExecutableNotFound) {
				continue // that backend is not installed
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", name, err))
				continue
			}
			if ok, err := ipt.ChainExists("nat", "KUBE-SERVICES"); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", name, err))
			} else if ok {
				return Source{Mode: audit.ModeIPTables, Legacy: legacy}, nil
			}
		}
	}
	if len(errs) > 0 {
		joined := errors.Join(errs...)
		if denied(joined) {
			return Source{}, fmt.Errorf("%w (%v)", ErrNoPermission, joined)
		}
		return Source{}, fmt.Errorf("%w (%v)", ErrNoKubeProxy, joined)
	}
	return Source{}, ErrNoKubeProxy
}

// ErrNoPermission means the kernel refused to show the rules: the
// collector lacks what its securityContext should grant.
var ErrNoPermission = errors.New("cannot read kube-proxy's rules: permission denied. The collector needs root with CAP_NET_ADMIN " +
	"(and CAP_NET_RAW for the legacy iptables backend) in the node's network namespace (hostNetwork); the chart's collector " +
	"securityContext grants exactly these, so check that no admission policy or pod security setting removed them")

// denied reports whether err is the kernel refusing a netfilter query.
func denied(err error) bool {
	s := err.Error()
	return strings.Contains(s, "Permission denied") || strings.Contains(s, "Operation not permitted")
}
