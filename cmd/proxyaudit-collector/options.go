package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/collector"
)

// options are the collector's flags: defaults from the environment and the
// collector package, registered by addFlags, checked by validate. The help
// says what each is in a sentence or two; docs/collector.md says how it
// works and when to change it.
type options struct {
	node, aggregator, mode string
	interval, fullRead     time.Duration
	readBudget             float64
	kubeProxyMetrics       string
	nftReader, iptReader   string
	bpfRoot                string
	notifyMiB              int

	tokenFile, caFile, serverName string
	peersFile                     string
	conntrackFile                 string
	maxMessageBytes               int

	ctInterval time.Duration
	ctDelete   bool

	memLimitMiB int64
	once        bool
	snapshot    string
	cpuProfile  string
}

func defaultOptions() options {
	return options{
		node: os.Getenv("NODE_NAME"), aggregator: os.Getenv("PROXYAUDIT_AGGREGATOR"), mode: envOr("PROXYAUDIT_MODE", "auto"),
		interval: 10 * time.Second, fullRead: collector.DefaultFullReadInterval, readBudget: collector.DefaultReadBudget,
		kubeProxyMetrics: envOr("PROXYAUDIT_KUBE_PROXY_METRICS", collector.DefaultKubeProxyMetrics),
		nftReader:        envOr("PROXYAUDIT_NFT_READER", "netlink"), iptReader: envOr("PROXYAUDIT_IPTABLES_READER", "kernel"),
		bpfRoot:   envOr("PROXYAUDIT_BPF_ROOT", collector.DefaultBPFFS),
		notifyMiB: collector.DefaultNotifyBuffer >> 20,
		tokenFile: os.Getenv("PROXYAUDIT_TOKEN_FILE"), caFile: os.Getenv("PROXYAUDIT_CA_FILE"), serverName: os.Getenv("PROXYAUDIT_TLS_SERVER_NAME"),
		peersFile:       os.Getenv("PROXYAUDIT_PEERS_FILE"),
		conntrackFile:   os.Getenv("PROXYAUDIT_CONNTRACK_FILE"),
		maxMessageBytes: 16 << 20,
		ctInterval:      30 * time.Second,
		memLimitMiB:     40,
	}
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func (o *options) addFlags(fs *flag.FlagSet) {
	// Where the collector reports, and as whom.
	fs.StringVar(&o.node, "node-name", o.node, "name of this node, as the API knows it [NODE_NAME]")
	fs.StringVar(&o.aggregator, "aggregator", o.aggregator, "the aggregators' stream address, host:port (or several, comma-separated); a DNS name is resolved to every replica [PROXYAUDIT_AGGREGATOR]")
	fs.StringVar(&o.tokenFile, "token-file", o.tokenFile, "projected ServiceAccount token sent to the aggregator, re-read on each connection [PROXYAUDIT_TOKEN_FILE]")
	fs.StringVar(&o.caFile, "ca-file", o.caFile, "CA bundle that verifies the aggregator's certificate; empty means plain TCP, for local experiments only [PROXYAUDIT_CA_FILE]")
	fs.StringVar(&o.serverName, "tls-server-name", o.serverName, "name the aggregator's certificate must carry; empty means the --aggregator host when it is a DNS name [PROXYAUDIT_TLS_SERVER_NAME]")
	fs.StringVar(&o.peersFile, "peers-file", o.peersFile, "file on the node keeping the aggregator addresses last known, dialed after a restart while the node's DNS is down; empty keeps them in memory only [PROXYAUDIT_PEERS_FILE]")
	fs.StringVar(&o.conntrackFile, "conntrack-file", o.conntrackFile, "file on the node keeping the frontends whose conntrack flows are counted, those that left the rules included (a service scaled to zero), across restarts; empty keeps them in memory only [PROXYAUDIT_CONNTRACK_FILE]")
	fs.IntVar(&o.maxMessageBytes, "max-message-bytes", o.maxMessageBytes, "largest message accepted from the aggregator")

	// What is read, and how often.
	fs.StringVar(&o.mode, "mode", o.mode, "rules to read: auto (kube-proxy's rules, or Cilium's maps where kube-proxy left none or does not run), iptables, iptables-legacy, nftables, ipvs or cilium [PROXYAUDIT_MODE]")
	fs.StringVar(&o.bpfRoot, "bpf-root", o.bpfRoot, "the BPF filesystem Cilium pins its maps to (cilium-agent --bpf-root), read in cilium mode [PROXYAUDIT_BPF_ROOT]")
	fs.DurationVar(&o.interval, "interval", o.interval, "how often to report; the rules are read only when their change signal moved (IPVS: every time). Missing for 3 intervals is CollectorMissing")
	fs.DurationVar(&o.fullRead, "full-read-interval", o.fullRead, "longest time between two reads of rules that have a change signal: the backstop for what a signal can miss")
	fs.Float64Var(&o.readBudget, "read-budget", o.readBudget, "share of a core reads may average while the rules keep changing; a flush (the table emptied) is read at once whatever it holds")
	fs.StringVar(&o.iptReader, "iptables-reader", o.iptReader, "how to read iptables mode: kernel (netlink and getsockopt, only what changed) or iptables-save (every read whole; slower) [PROXYAUDIT_IPTABLES_READER]")
	fs.StringVar(&o.nftReader, "nft-reader", o.nftReader, "how to read nftables mode: netlink (only what changed) or nft-json (`nft -j list table`; slower) [PROXYAUDIT_NFT_READER]")
	fs.IntVar(&o.notifyMiB, "notification-buffer-mib", o.notifyMiB, "receive buffer of the nf_tables change notifications in MiB (0: the kernel's default)")
	fs.StringVar(&o.kubeProxyMetrics, "kube-proxy-metrics", o.kubeProxyMetrics, "kube-proxy's metrics URL, scraped with each read for its last sync and pending changes; empty disables [PROXYAUDIT_KUBE_PROXY_METRICS]")

	// Conntrack.
	fs.DurationVar(&o.ctInterval, "conntrack-interval", o.ctInterval, "least time between two reads of the node's conntrack table, for flows still DNATed to endpoints that are gone; 0 turns it off")
	fs.BoolVar(&o.ctDelete, "conntrack-delete", o.ctDelete, "let the aggregator have stale conntrack entries deleted: only entries DNATed to a destination this node's own rules no longer use, UDP and unanswered TCP attempts")

	// The process.
	fs.Int64Var(&o.memLimitMiB, "memory-limit-mib", o.memLimitMiB, "soft limit of the Go heap in MiB (GOMEMLIMIT wins when set); 0 turns it off")
	fs.BoolVar(&o.once, "once", o.once, "read the rules once, print what the collector sees and what the read cost as JSON, and exit; needs no aggregator")
	fs.StringVar(&o.snapshot, "snapshot", o.snapshot, "with --once: also write the snapshot the collector would stream to this file (`proxyaudit diff --rules NODE=FILE` audits it); -: one line of JSON on stdout with the footprint")
	fs.StringVar(&o.cpuProfile, "cpu-profile", o.cpuProfile, "debugging: write a Go CPU profile of the whole run to this file")
}

// validate checks the flags that do not need the files they name; what
// --once leaves out (no aggregator, no node) it does not ask for.
func (o *options) validate() error {
	if o.notifyMiB < 0 || o.notifyMiB > 1024 {
		return fmt.Errorf("--notification-buffer-mib %d: want 0 to 1024", o.notifyMiB)
	}
	if o.nftReader != "netlink" && o.nftReader != "nft-json" {
		return fmt.Errorf("--nft-reader %q: want netlink or nft-json", o.nftReader)
	}
	if o.iptReader != "kernel" && o.iptReader != "iptables-save" {
		return fmt.Errorf("--iptables-reader %q: want kernel or iptables-save", o.iptReader)
	}
	if _, _, err := collector.ParseMode(o.mode); err != nil {
		return err
	}
	if o.once {
		return nil
	}
	if o.snapshot != "" {
		return errors.New("--snapshot is for --once (a running collector streams its snapshots)")
	}
	if o.node == "" {
		return errors.New("--node-name is required (in a DaemonSet, set NODE_NAME from spec.nodeName)")
	}
	if o.aggregator == "" {
		return errors.New("--aggregator is required (host:port of the aggregator's stream listener)")
	}
	if o.interval < time.Second {
		return fmt.Errorf("--interval %s is too short: at least 1s", o.interval)
	}
	if o.fullRead < o.interval {
		return fmt.Errorf("--full-read-interval %s is shorter than --interval %s", o.fullRead, o.interval)
	}
	if o.readBudget <= 0 || o.readBudget > 1 {
		return fmt.Errorf("--read-budget %g: want a share of a core in (0, 1]", o.readBudget)
	}
	if o.ctInterval < 0 || (o.ctInterval > 0 && o.ctInterval < o.interval) {
		return fmt.Errorf("--conntrack-interval %s: at least --interval %s, or 0 to turn it off", o.ctInterval, o.interval)
	}
	if o.ctDelete && o.ctInterval == 0 {
		return errors.New("--conntrack-delete takes --conntrack-interval above 0 (the flows are judged from what it reads)")
	}
	if o.maxMessageBytes < 1<<10 {
		return fmt.Errorf("--max-message-bytes %d: at least 1024", o.maxMessageBytes)
	}
	if o.caFile != "" && o.serverName == "" && dnsHost(o.aggregator) == "" {
		return errors.New("--ca-file: --aggregator names replicas by IP; set --tls-server-name to the name in the aggregator's certificate")
	}
	return nil
}

// host is the collector's access to this node's kernel and tools, as the
// reader flags choose.
func (o *options) host() *collector.Host {
	h := collector.NewHost()
	h.NotifyBuffer = o.notifyMiB << 20
	h.NFTJSON = o.nftReader == "nft-json"
	h.IPTablesSave = o.iptReader == "iptables-save"
	h.BPFFS = o.bpfRoot
	if o.kubeProxyMetrics != "" {
		h.KubeProxyAnswers = collector.Listening(o.kubeProxyMetrics)
	}
	return h
}
