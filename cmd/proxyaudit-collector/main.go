// Command proxyaudit-collector runs on every node (hostNetwork): it reads
// the node's kube-proxy rules every interval and streams them to the
// proxyaudit aggregator.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/proxyaudit/proxyaudit/internal/collector"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/tlsfile"
	"github.com/sirupsen/logrus"
)

const usage = `proxyaudit-collector reads this node's kube-proxy rules (iptables, nftables,
IPVS) and streams them to the proxyaudit aggregator, which compares them with
the cluster's Services and EndpointSlices.

It reads only when the rules may have changed: nf_tables (iptables-nft and
nftables mode) announces every commit and numbers the ruleset's generations;
the legacy iptables backend is watched through its nat table's size. A quiet
node sends a ~100-byte heartbeat every --interval and reads nothing; a change
is read about 0.1 s after it is committed; --full-read-interval bounds what a
signal can miss. IPVS has no change signal and is read every interval.

Usage:
  proxyaudit-collector --node-name NODE --aggregator HOST:PORT [flags]

Flags (environment fallbacks in brackets):
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("proxyaudit-collector", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	node := fs.String("node-name", os.Getenv("NODE_NAME"), "name of this node, as the API knows it [NODE_NAME]")
	agg := fs.String("aggregator", os.Getenv("PROXYAUDIT_AGGREGATOR"), "aggregator stream address host:port (or several, comma-separated); a DNS name is resolved to every replica and the leader is found [PROXYAUDIT_AGGREGATOR]")
	mode := fs.String("mode", envOr("PROXYAUDIT_MODE", "auto"), "rules to read: auto (detect what kube-proxy programs), iptables, iptables-legacy, nftables, ipvs [PROXYAUDIT_MODE]")
	interval := fs.Duration("interval", 10*time.Second, "heartbeat: how often to report (reading only when the change signal moved; IPVS always reads); the aggregator declares the collector missing after 3 intervals without a report")
	fullRead := fs.Duration("full-read-interval", collector.DefaultFullReadInterval, "longest time between two reads of rules that have a change signal: the backstop for what a signal can miss (a same-size rewrite of one rule on the legacy iptables backend); on nf_tables, whose generation misses nothing, a guard read every 12 × this")
	readBudget := fs.Float64("read-budget", collector.DefaultReadBudget, "share of a core reads may average while the rules keep changing: reads spend from a bucket of CPU time that fills at this share up to a minute's worth and wait while it is in debt (at least 1 s, at most --interval apart), so where every read is whole and dear (legacy iptables at 10k services) a node under churn reads about once an interval instead of after every kube-proxy commit; a change after a quiet spell is read at once")
	tokenFile := fs.String("token-file", os.Getenv("PROXYAUDIT_TOKEN_FILE"), "projected ServiceAccount token sent to the aggregator, re-read on each connection [PROXYAUDIT_TOKEN_FILE]")
	caFile := fs.String("ca-file", os.Getenv("PROXYAUDIT_CA_FILE"), "CA bundle to verify the aggregator's TLS certificate; empty means plain TCP (local experiments only) [PROXYAUDIT_CA_FILE]")
	serverName := fs.String("tls-server-name", os.Getenv("PROXYAUDIT_TLS_SERVER_NAME"), "name the aggregator's certificate must carry; empty means the --aggregator host when it is a DNS name (replicas are dialled by IP, so an IP-only --aggregator needs this) [PROXYAUDIT_TLS_SERVER_NAME]")
	kpMetrics := fs.String("kube-proxy-metrics", envOr("PROXYAUDIT_KUBE_PROXY_METRICS", collector.DefaultKubeProxyMetrics), "kube-proxy's metrics URL, scraped with each read and forwarded as a second signal (last sync, pending changes); empty disables [PROXYAUDIT_KUBE_PROXY_METRICS]")
	nftReader := fs.String("nft-reader", envOr("PROXYAUDIT_NFT_READER", "netlink"), "how to read nftables mode: netlink (the kernel's nf_tables dumps, decoding only what the audit needs) or nft-json (`nft -j list table ip|ip6 kube-proxy`, slower; a fallback) [PROXYAUDIT_NFT_READER]")
	iptReader := fs.String("iptables-reader", envOr("PROXYAUDIT_IPTABLES_READER", "kernel"), "how to read iptables mode: kernel (iptables-nft's nf_tables rules over netlink, then only the chains each commit touched; the legacy backend's table with the getsockopt iptables-legacy-save uses; no binary needed, and a rule the decoder cannot read falls back to the tool for that read) or iptables-save (`iptables-save -t nat` and `ip6tables-save -t nat`, or their -legacy tools, at every read: slower, and a large table under kube-proxy's churn cannot be read at all) [PROXYAUDIT_IPTABLES_READER]")
	memLimit := fs.Int64("memory-limit-mib", 40, "soft limit for the Go heap in MiB (GOMEMLIMIT, which wins when set): the collector reads rarely, so the garbage collector keeps a quiet node's collector small instead of letting a read's garbage double the footprint; a heap that needs more grows past it; 0 turns it off")
	once := fs.Bool("once", false, "read the rules once, print what the collector sees as JSON (mode, frontends, endpoints, snapshot bytes, CPU and peak memory of the read and of the tool it ran) and exit; needs no aggregator")
	snapshot := fs.String("snapshot", "", "with --once: also write the full snapshot the collector would stream (JSON) to this file; `proxyaudit diff --rules NODE=FILE` audits it")
	maxMsg := fs.Int("max-message-bytes", 16<<20, "largest message accepted from the aggregator")
	notifyMiB := fs.Int("notification-buffer-mib", collector.DefaultNotifyBuffer>>20, "receive buffer of the nf_tables change notifications in MiB (0: the kernel's default): one kube-proxy commit at 10k services announces tens of thousands of objects, and the nftables reader learns kube-proxy's new maps from them instead of dumping each; an overrun loses only that. The kernel charges it to the collector's cgroup while notifications wait to be read")
	ctDelete := fs.Bool("conntrack-delete", false, "let the aggregator have stale conntrack entries deleted (its --remediation-conntrack): only entries DNATed to a destination this node's own rules no longer send the frontend to, UDP, and TCP connection attempts never answered when asked; everything else is refused whatever the aggregator asks. Needs --conntrack-interval above 0")
	ctInterval := fs.Duration("conntrack-interval", 30*time.Second, "least time between two reads of the node's conntrack table (one netlink dump of the DNATed entries, counted per service frontend and destination; 1.2 s and under 1 MB per read at a million entries), sent when the counts change by more than noise: the aggregator finds flows still DNATed to endpoints that are gone (StaleConntrack); 0 turns it off")
	cpuProfile := fs.String("cpu-profile", "", "debugging: write a Go CPU profile of the whole run to this file (`go tool pprof`), finished when the collector stops")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "proxyaudit-collector: "+format+"\n", a...)
		return 2
	}
	if os.Getenv("GOMEMLIMIT") == "" && *memLimit > 0 {
		debug.SetMemoryLimit(*memLimit << 20)
	}
	host := collector.NewHost()
	if *notifyMiB < 0 || *notifyMiB > 1024 {
		return fail("--notification-buffer-mib %d: want 0 to 1024", *notifyMiB)
	}
	host.NotifyBuffer = *notifyMiB << 20
	switch *nftReader {
	case "netlink":
	case "nft-json":
		host.NFTJSON = true
	default:
		return fail("--nft-reader %q: want netlink or nft-json", *nftReader)
	}
	switch *iptReader {
	case "kernel":
	case "iptables-save":
		host.IPTablesSave = true
	default:
		return fail("--iptables-reader %q: want kernel or iptables-save", *iptReader)
	}
	if *once {
		return readOnce(host, *mode, *snapshot, stdout, fail)
	}
	if *node == "" {
		return fail("--node-name is required (in a DaemonSet, set NODE_NAME from spec.nodeName)")
	}
	if *agg == "" {
		return fail("--aggregator is required (host:port of the aggregator's stream listener)")
	}
	if *interval < time.Second {
		return fail("--interval %s is too short: at least 1s", *interval)
	}
	if *fullRead < *interval {
		return fail("--full-read-interval %s is shorter than --interval %s", *fullRead, *interval)
	}
	if *readBudget <= 0 || *readBudget > 1 {
		return fail("--read-budget %g: want a share of a core in (0, 1]", *readBudget)
	}
	if *ctInterval < 0 || (*ctInterval > 0 && *ctInterval < *interval) {
		return fail("--conntrack-interval %s: at least --interval %s, or 0 to turn it off", *ctInterval, *interval)
	}
	cfg := collector.Config{Node: *node, Aggregator: *agg, Interval: *interval, FullReadInterval: *fullRead, ReadBudget: *readBudget, TokenFile: *tokenFile, MaxMessageBytes: *maxMsg, Version: version(), KubeProxyMetrics: *kpMetrics}
	src, fixed, err := collector.ParseMode(*mode)
	if err != nil {
		return fail("%v", err)
	}
	cfg.Host = host
	if *ctInterval > 0 {
		cfg.Conntrack, cfg.ConntrackInterval, cfg.ConntrackDelete = &collector.ConntrackReader{}, *ctInterval, *ctDelete
	} else if *ctDelete {
		return fail("--conntrack-delete takes --conntrack-interval above 0 (the flows are judged from what it reads)")
	}
	if fixed {
		cfg.Reader = host.Reader(src)
	}
	var caMissing error
	if *caFile != "" {
		pool, err := tlsfile.LoadCA(*caFile)
		if errors.Is(err, os.ErrNotExist) {
			// The chart's aggregator makes the CA on its first start; the
			// kubelet projects it a little later. Read at each connection.
			pool, caMissing = x509.NewCertPool(), err
		} else if err != nil {
			return fail("--ca-file: %v", err)
		}
		name := *serverName
		if name == "" {
			name = dnsHost(*agg)
		}
		if name == "" {
			return fail("--ca-file: --aggregator names replicas by IP; set --tls-server-name to the name in the aggregator's certificate")
		}
		cfg.TLS = &tls.Config{RootCAs: pool, ServerName: name, MinVersion: tls.VersionTLS12}
		cfg.CAFile = *caFile // re-read at each connection
	}
	log, err := zap.NewProduction()
	if err != nil {
		return fail("logger: %v", err)
	}
	defer log.Sync()
	cfg.Log = log.With(zap.String("node", *node))
	if caMissing != nil {
		cfg.Log.Warn("no CA bundle yet: connections fail verification until it appears (the aggregator makes it on its first start)", zap.Error(caMissing))
	}
	// moby/ipvs logs through logrus (when it runs modprobe ip_vs).
	logrus.SetOutput(zap.NewStdLog(log.Named("ipvs")).Writer())
	if cfg.TLS == nil {
		cfg.Log.Warn("streaming without TLS (--ca-file not set): use only for local experiments")
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return fail("--cpu-profile: %v", err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			return fail("--cpu-profile: %v", err)
		}
		defer f.Close()
		defer pprof.StopCPUProfile()
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := collector.Run(ctx, cfg); err != nil {
		return fail("%v", err)
	}
	return 0
}

// dnsHost is the first DNS name among the --aggregator addresses, or "".
// The collector resolves it and dials replicas by IP, so the name has to be
// carried to the TLS handshake explicitly.
func dnsHost(aggregators string) string {
	for _, a := range strings.Split(aggregators, ",") {
		host, _, err := net.SplitHostPort(strings.TrimSpace(a))
		if err == nil && host != "" && net.ParseIP(host) == nil {
			return host
		}
	}
	return ""
}

func version() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "devel"
}

// Footprint is what --once prints.
type Footprint struct {
	Mode          string  `json:"mode"`
	NoRules       bool    `json:"noRules"`
	Frontends     int     `json:"frontends"`
	Endpoints     int     `json:"endpoints"`
	SnapshotBytes int     `json:"snapshotBytes"`
	ReadSeconds   float64 `json:"readSeconds"`
	// Self is the collector process (peak RSS from VmHWM: getrusage's
	// maxrss would include the parent that forked it); Tool is the CPU of
	// the tool it ran (iptables-save, nft; none for IPVS, read over netlink).
	SelfCPUSeconds  float64 `json:"selfCPUSeconds"`
	SelfMaxRSSBytes int64   `json:"selfMaxRSSBytes"`
	ToolCPUSeconds  float64 `json:"toolCPUSeconds"`
}

func readOnce(host *collector.Host, mode, snapshot string, stdout io.Writer, fail func(string, ...any) int) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	src, fixed, err := collector.ParseMode(mode)
	if err != nil {
		return fail("%v", err)
	}
	// moby/ipvs warns through logrus when modprobe is missing (a
	// collector image has none): the read says whether the table is there.
	logrus.SetOutput(io.Discard)
	if !fixed {
		if src, err = host.Detect(ctx); err != nil {
			return fail("%v", err)
		}
	}
	reader := host.Reader(src)
	start := time.Now()
	obs, err := reader.Read(ctx)
	if err != nil {
		return fail("read %s rules: %v", reader, err)
	}
	took := time.Since(start)
	st := stream.FromModel(obs)
	msg := &stream.Message{Type: stream.TypeReport, Report: stream.Delta(stream.NewState(), st, 1, true, false)}
	var size countWriter
	stream.Write(&size, msg)
	if snapshot != "" {
		data, err := json.MarshalIndent(msg, "", " ")
		if err != nil {
			return fail("--snapshot: %v", err)
		}
		if err := os.WriteFile(snapshot, append(data, '\n'), 0o644); err != nil {
			return fail("--snapshot: %v", err)
		}
	}
	f := Footprint{Mode: reader.String(), NoRules: obs.NoRules, Frontends: len(obs.Frontends), SnapshotBytes: int(size), ReadSeconds: took.Seconds()}
	for _, fe := range obs.Frontends {
		f.Endpoints += len(fe.Endpoints)
	}
	var self, child syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &self)
	syscall.Getrusage(syscall.RUSAGE_CHILDREN, &child)
	cpu := func(r syscall.Rusage) float64 {
		return time.Duration(r.Utime.Nano() + r.Stime.Nano()).Seconds()
	}
	f.SelfCPUSeconds, f.SelfMaxRSSBytes, f.ToolCPUSeconds = cpu(self), peakRSS(), cpu(child)
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	enc.Encode(f)
	return 0
}

type countWriter int

func (c *countWriter) Write(p []byte) (int, error) { *c += countWriter(len(p)); return len(p), nil }

// peakRSS is this process's VmHWM in bytes (0 when unknown).
func peakRSS() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb * 1024
		}
	}
	return 0
}
