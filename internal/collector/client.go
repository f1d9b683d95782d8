package collector

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// Config is what a collector needs to run.
type Config struct {
	Node string
	// Aggregator is host:port, or a comma-separated list; a host name is
	// resolved to every address (a headless Service lists every replica)
	// and each is tried until one answers (the leader, or a follower that
	// redirects to it).
	Aggregator string
	// Source is the rule source; nil detects it (and retries detection
	// every interval until kube-proxy has programmed the node).
	Source   *Source
	Interval time.Duration
	// TokenFile is the projected ServiceAccount token, re-read on every
	// connection (the kubelet rotates it).
	TokenFile string
	// TLS, when set, wraps the stream.
	TLS             *tls.Config
	MaxMessageBytes int
	Version         string
	Log             *zap.Logger
	// KubeProxyMetrics is kube-proxy's metrics URL, scraped with each read
	// as a second signal; empty disables it.
	KubeProxyMetrics string
	// Read replaces Source.Read in tests of the protocol.
	Read func(context.Context) (*audit.Observed, error)
}

// Run connects to the aggregator and reports until ctx ends, reconnecting
// with jittered exponential backoff (1 s to 30 s) and following redirects
// to the leader.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Node == "" {
		return errors.New("node name is empty (set --node-name or NODE_NAME)")
	}
	if cfg.Interval <= 0 {
		cfg.Interval = 10 * time.Second
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = stream.DefaultMaxMessageBytes
	}
	if cfg.Log == nil {
		cfg.Log = zap.NewNop()
	}
	c := &client{cfg: cfg, src: cfg.Source}
	backoff := time.Second
	preferred := ""
	for ctx.Err() == nil {
		leader, err := c.session(ctx, preferred)
		switch {
		case ctx.Err() != nil:
			return nil
		case leader != "":
			cfg.Log.Info("following the aggregator leader", zap.String("leader", leader))
			preferred, backoff = leader, time.Second
			continue
		case err != nil:
			cfg.Log.Warn("stream to the aggregator ended", zap.Error(err), zap.Duration("retry_in", backoff))
		}
		preferred = ""
		jitter := time.Duration(rand.Int64N(int64(backoff)/2 + 1))
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff/2 + jitter):
		}
		backoff = min(2*backoff, 30*time.Second)
	}
	return nil
}

type client struct {
	cfg    Config
	src    *Source
	seq    uint64
	lastKP *stream.KubeProxy // sent on this stream
	http   http.Client
}

// addresses resolves the aggregator (host:port, or several separated by
// commas) to every address, the preferred first.
func (c *client) addresses(ctx context.Context, preferred string) ([]string, error) {
	var out []string
	if preferred != "" {
		out = append(out, preferred)
	}
	var errs []error
	for _, a := range strings.Split(c.cfg.Aggregator, ",") {
		host, port, err := net.SplitHostPort(strings.TrimSpace(a))
		if err != nil {
			return nil, fmt.Errorf("--aggregator %q: want host:port", a)
		}
		if net.ParseIP(host) != nil {
			out = append(out, net.JoinHostPort(host, port))
			continue
		}
		ips, err := net.DefaultResolver.LookupHost(ctx, host)
		if err != nil {
			errs = append(errs, fmt.Errorf("resolve %s: %w", host, err))
			continue
		}
		for _, ip := range ips {
			out = append(out, net.JoinHostPort(ip, port))
		}
	}
	return out, errors.Join(errs...)
}

// session runs one connection. It returns the leader's address when the
// aggregator redirects, or the error that ended it.
func (c *client) session(ctx context.Context, preferred string) (string, error) {
	addrs, err := c.addresses(ctx, preferred)
	if len(addrs) == 0 {
		return "", err
	}
	var conn net.Conn
	var errs []error
	for _, a := range addrs {
		d := net.Dialer{Timeout: 5 * time.Second}
		if c.cfg.TLS != nil {
			conn, err = (&tls.Dialer{NetDialer: &d, Config: c.cfg.TLS}).DialContext(ctx, "tcp", a)
		} else {
			conn, err = d.DialContext(ctx, "tcp", a)
		}
		if err == nil {
			break
		}
		errs = append(errs, err)
	}
	if conn == nil {
		return "", fmt.Errorf("no aggregator reachable: %w", errors.Join(errs...))
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()

	token := ""
	if c.cfg.TokenFile != "" {
		b, err := os.ReadFile(c.cfg.TokenFile)
		if err != nil {
			return "", fmt.Errorf("read token: %w", err)
		}
		token = strings.TrimSpace(string(b))
	}
	hello := &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{
		Node: c.cfg.Node, Token: token, Version: c.cfg.Version, IntervalSeconds: c.cfg.Interval.Seconds()}}
	if err := stream.Write(conn, hello); err != nil {
		return "", err
	}
	conn.SetReadDeadline(time.Now().Add(15 * time.Second))
	reply, _, err := stream.Read(conn, c.cfg.MaxMessageBytes)
	if err != nil {
		return "", fmt.Errorf("waiting for the aggregator's answer: %w", err)
	}
	conn.SetReadDeadline(time.Time{})
	switch reply.Type {
	case stream.TypeWelcome:
	case stream.TypeRedirect:
		if reply.Redirect == nil || reply.Redirect.Leader == "" {
			return "", errors.New("redirected without a leader address (no leader elected yet?)")
		}
		return reply.Redirect.Leader, nil
	case stream.TypeReject:
		reason := "no reason given"
		if reply.Reject != nil {
			reason = reply.Reject.Reason
		}
		return "", fmt.Errorf("aggregator rejected this collector: %s", reason)
	default:
		return "", fmt.Errorf("unexpected %q answer to hello", reply.Type)
	}
	c.cfg.Log.Info("streaming to the aggregator", zap.String("aggregator", conn.RemoteAddr().String()))

	// The aggregator may ask for a resync or name a new leader at any time.
	incoming := make(chan *stream.Message, 4)
	readErr := make(chan error, 1)
	go func() {
		for {
			m, _, err := stream.Read(conn, c.cfg.MaxMessageBytes)
			if err != nil {
				readErr <- err
				return
			}
			incoming <- m
		}
	}()
	sent := stream.NewState()
	c.lastKP = nil
	full := true
	tick := time.NewTicker(c.cfg.Interval)
	defer tick.Stop()
	for {
		lastRead := time.Now()
		var soon <-chan time.Time // a read-now request waiting out minReadGap
		report := c.read(ctx, sent, full)
		if err := stream.Write(conn, &stream.Message{Type: stream.TypeReport, Report: report}); err != nil {
			return "", err
		}
		if report.ReadError == "" {
			full = false
		}
	wait:
		for {
			select {
			case <-ctx.Done():
				return "", nil
			case err := <-readErr:
				return "", err
			case m := <-incoming:
				switch m.Type {
				case stream.TypeResync:
					full = true
					break wait // answer at once
				case stream.TypeReadNow:
					// Reads start at least minReadGap apart: a read
					// costs seconds of CPU at the anchors. A request
					// inside the gap is answered when it ends.
					left := minReadGap - time.Since(lastRead)
					if left <= 0 {
						break wait
					}
					if soon == nil {
						soon = time.After(left)
					}
				case stream.TypeRedirect:
					if m.Redirect != nil && m.Redirect.Leader != "" {
						return m.Redirect.Leader, nil
					}
				case stream.TypeReject:
					if m.Reject != nil {
						return "", fmt.Errorf("aggregator ended the stream: %s", m.Reject.Reason)
					}
					return "", errors.New("aggregator ended the stream")
				}
			case <-tick.C:
				break wait
			case <-soon:
				break wait
			}
		}
	}
}

// minReadGap is the least time between the starts of two reads that the
// aggregator's read-now requests can cause.
const minReadGap = time.Second

// read reads the rules once and builds the report against what was sent.
func (c *client) read(ctx context.Context, sent *stream.State, full bool) *stream.Report {
	c.seq++
	var r *stream.Report
	obs, err := c.readRules(ctx)
	if err != nil {
		c.cfg.Log.Warn("cannot read kube-proxy's rules", zap.Error(err))
		r = &stream.Report{Seq: c.seq, Root: sent.Root(), Mode: sent.Mode, ReadError: err.Error()}
	} else {
		r = stream.Delta(sent, stream.FromModel(obs), c.seq, full)
	}
	if c.cfg.KubeProxyMetrics != "" {
		kp := ScrapeKubeProxy(ctx, &c.http, c.cfg.KubeProxyMetrics)
		if c.lastKP == nil || *kp != *c.lastKP {
			r.KubeProxy, c.lastKP = kp, kp
		}
	}
	return r
}

func (c *client) readRules(ctx context.Context) (*audit.Observed, error) {
	if c.cfg.Read != nil {
		return c.cfg.Read(ctx)
	}
	if c.src == nil {
		src, err := Detect(ctx)
		if err != nil {
			return nil, err
		}
		c.cfg.Log.Info("detected kube-proxy mode", zap.Stringer("mode", src))
		c.src = &src
	}
	rctx, cancel := context.WithTimeout(ctx, max(c.cfg.Interval, 30*time.Second))
	defer cancel()
	return c.src.Read(rctx)
}
