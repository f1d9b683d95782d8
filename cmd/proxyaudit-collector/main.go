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

	"github.com/proxyaudit/proxyaudit/dataplane/conntrack"
	"github.com/proxyaudit/proxyaudit/internal/buildinfo"
	"github.com/proxyaudit/proxyaudit/internal/collector"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/tlsfile"
	"github.com/sirupsen/logrus"
)

const usage = `proxyaudit-collector reads this node's kube-proxy rules (iptables, nftables,
IPVS), or Cilium's service maps where Cilium replaces kube-proxy, and streams
them to the proxyaudit aggregator, which compares them with the cluster's
Services and EndpointSlices.

It reads only when the rules may have changed: nf_tables (iptables-nft and
nftables mode) announces every commit and numbers the ruleset's generations;
the legacy iptables backend is watched through its nat table's size. A quiet
node sends a ~100-byte heartbeat every --interval and reads nothing; a change
is read about 0.1 s after it is committed; --full-read-interval bounds what a
signal can miss. IPVS and Cilium's maps have no change signal and are read
every interval (Cilium's read-only, from the BPF filesystem: --bpf-root).

Usage:
  proxyaudit-collector --node-name NODE --aggregator HOST:PORT [flags]
  proxyaudit-collector --once [--mode MODE] [--snapshot FILE]

Flags (environment fallbacks in brackets; docs/collector.md says how each works):
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("proxyaudit-collector", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	o := defaultOptions()
	o.addFlags(fs)
	showVersion := fs.Bool("version", false, "print the version, commit and build date, and exit")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if *showVersion {
		fmt.Fprintln(stdout, "proxyaudit-collector "+buildinfo.Get().String())
		return 0
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "proxyaudit-collector: "+format+"\n", a...)
		return 2
	}
	if fs.NArg() > 0 {
		return fail("unexpected argument %q (flags only; --help lists them)", fs.Arg(0))
	}
	if err := o.validate(); err != nil {
		return fail("%v", err)
	}
	if os.Getenv("GOMEMLIMIT") == "" && o.memLimitMiB > 0 {
		debug.SetMemoryLimit(o.memLimitMiB << 20)
	}
	host := o.host()
	if o.once {
		return readOnce(host, o.mode, o.snapshot, stdout, fail)
	}
	cfg := collector.Config{Node: o.node, Aggregator: o.aggregator, Interval: o.interval, FullReadInterval: o.fullRead, ReadBudget: o.readBudget,
		TokenFile: o.tokenFile, MaxMessageBytes: o.maxMessageBytes, Version: version(), KubeProxyMetrics: o.kubeProxyMetrics, Host: host,
		PeersFile: o.peersFile, ConntrackFile: o.conntrackFile}
	if src, fixed, _ := collector.ParseMode(o.mode); fixed {
		cfg.Reader = host.Reader(src)
	}
	if o.ctInterval > 0 {
		cfg.Conntrack, cfg.ConntrackInterval, cfg.ConntrackDelete = &conntrack.Reader{}, o.ctInterval, o.ctDelete
	}
	var caMissing error
	if o.caFile != "" {
		pool, err := tlsfile.LoadCA(o.caFile)
		if errors.Is(err, os.ErrNotExist) {
			// The chart's aggregator makes the CA on its first start; the
			// kubelet projects it a little later. Read at each connection.
			pool, caMissing = x509.NewCertPool(), err
		} else if err != nil {
			return fail("--ca-file: %v", err)
		}
		name := o.serverName
		if name == "" {
			name = dnsHost(o.aggregator) // validate made sure there is one
		}
		cfg.TLS = &tls.Config{RootCAs: pool, ServerName: name, MinVersion: tls.VersionTLS12}
		cfg.CAFile = o.caFile // re-read at each connection
	}
	log, err := zap.NewProduction()
	if err != nil {
		return fail("logger: %v", err)
	}
	defer log.Sync()
	cfg.Log = log.With(zap.String("node", o.node))
	if caMissing != nil {
		cfg.Log.Warn("no CA bundle yet: connections fail verification until it appears (the aggregator makes it on its first start)", zap.Error(caMissing))
	}
	// moby/ipvs logs through logrus (when it runs modprobe ip_vs).
	logrus.SetOutput(zap.NewStdLog(log.Named("ipvs")).Writer())
	if cfg.TLS == nil {
		cfg.Log.Warn("streaming without TLS (--ca-file not set): use only for local experiments")
	}
	if o.cpuProfile != "" {
		f, err := os.Create(o.cpuProfile)
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

func version() string { return buildinfo.Version() }

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
		if src.Note != "" {
			fmt.Fprintln(os.Stderr, "proxyaudit-collector: warning: "+src.Note)
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
	if snapshot != "" && snapshot != "-" {
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
	if snapshot == "-" {
		// One line, the footprint and the snapshot together: what
		// `proxyaudit check` reads back from the pod's log.
		return encodeOr(fail, json.NewEncoder(stdout).Encode(OnceLine{Footprint: f, Snapshot: msg}))
	}
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	enc.Encode(f)
	return 0
}

// OnceLine is what --once --snapshot - prints: one line of JSON.
type OnceLine struct {
	Footprint Footprint       `json:"footprint"`
	Snapshot  *stream.Message `json:"snapshot"`
}

func encodeOr(fail func(string, ...any) int, err error) int {
	if err != nil {
		return fail("write the snapshot: %v", err)
	}
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
