// Command proxyaudit-collector runs on every node (hostNetwork): it reads
// the node's kube-proxy rules every interval and streams them to the
// proxyaudit aggregator.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/proxyaudit/proxyaudit/internal/collector"
)

const usage = `proxyaudit-collector reads this node's kube-proxy rules (iptables, nftables)
every interval and streams them to the proxyaudit aggregator, which compares
them with the cluster's Services and EndpointSlices.

Usage:
  proxyaudit-collector --node-name NODE --aggregator HOST:PORT [flags]

Flags (environment fallbacks in brackets):
`

func main() {
	os.Exit(run(os.Args[1:], os.Stderr))
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func run(args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("proxyaudit-collector", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	node := fs.String("node-name", os.Getenv("NODE_NAME"), "name of this node, as the API knows it [NODE_NAME]")
	agg := fs.String("aggregator", os.Getenv("PROXYAUDIT_AGGREGATOR"), "aggregator stream address host:port (or several, comma-separated); a DNS name is resolved to every replica and the leader is found [PROXYAUDIT_AGGREGATOR]")
	mode := fs.String("mode", envOr("PROXYAUDIT_MODE", "auto"), "rules to read: auto (detect what kube-proxy programs), iptables, iptables-legacy, nftables [PROXYAUDIT_MODE]")
	interval := fs.Duration("interval", 10*time.Second, "how often to read the rules; the aggregator declares the collector missing after 3 intervals without a report")
	tokenFile := fs.String("token-file", os.Getenv("PROXYAUDIT_TOKEN_FILE"), "projected ServiceAccount token sent to the aggregator, re-read on each connection [PROXYAUDIT_TOKEN_FILE]")
	caFile := fs.String("ca-file", os.Getenv("PROXYAUDIT_CA_FILE"), "CA bundle to verify the aggregator's TLS certificate; empty means plain TCP (local experiments only) [PROXYAUDIT_CA_FILE]")
	kpMetrics := fs.String("kube-proxy-metrics", envOr("PROXYAUDIT_KUBE_PROXY_METRICS", collector.DefaultKubeProxyMetrics), "kube-proxy's metrics URL, scraped with each read and forwarded as a second signal (last sync, pending changes); empty disables [PROXYAUDIT_KUBE_PROXY_METRICS]")
	maxMsg := fs.Int("max-message-bytes", 16<<20, "largest message accepted from the aggregator")
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
	if *node == "" {
		return fail("--node-name is required (in a DaemonSet, set NODE_NAME from spec.nodeName)")
	}
	if *agg == "" {
		return fail("--aggregator is required (host:port of the aggregator's stream listener)")
	}
	if *interval < time.Second {
		return fail("--interval %s is too short: at least 1s", *interval)
	}
	cfg := collector.Config{Node: *node, Aggregator: *agg, Interval: *interval, TokenFile: *tokenFile, MaxMessageBytes: *maxMsg, Version: version(), KubeProxyMetrics: *kpMetrics}
	src, fixed, err := collector.ParseMode(*mode)
	if err != nil {
		return fail("%v", err)
	}
	if fixed {
		cfg.Source = &src
	}
	if *caFile != "" {
		pem, err := os.ReadFile(*caFile)
		if err != nil {
			return fail("--ca-file: %v", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return fail("--ca-file %s: no PEM certificates in it", *caFile)
		}
		cfg.TLS = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	}
	log, err := zap.NewProduction()
	if err != nil {
		return fail("logger: %v", err)
	}
	defer log.Sync()
	cfg.Log = log.With(zap.String("node", *node))
	if cfg.TLS == nil {
		cfg.Log.Warn("streaming without TLS (--ca-file not set): use only for local experiments")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := collector.Run(ctx, cfg); err != nil {
		return fail("%v", err)
	}
	return 0
}

func version() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "devel"
}
