package collector

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/tlsfile"
)

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
		lookup := c.cfg.Lookup
		if lookup == nil {
			lookup = net.DefaultResolver.LookupHost
		}
		lctx, cancel := ctx, context.CancelFunc(func() {})
		if len(c.resolved[host]) > 0 {
			// A node whose DNS is gone with its rules answers nothing
			// until the resolver's timeouts and search domains run out
			// (a collector restarted on a flushed node waited 55 s):
			// with addresses to fall back on, DNS gets a few seconds.
			lctx, cancel = context.WithTimeout(ctx, lookupWithFallback)
		}
		ips, err := lookup(lctx, host)
		cancel()
		if err != nil {
			// The node's DNS goes to the cluster DNS Service through this
			// node's own kube-proxy: when that kube-proxy is stale and the
			// DNS pods moved, the name cannot be resolved, which is when
			// the node must be heard. Use what it resolved to last.
			if last := c.resolved[host]; len(last) > 0 {
				c.cfg.Log.Warn("cannot resolve the aggregator: using the addresses it resolved to last (the node's DNS goes through its own kube-proxy, which may be stale)",
					zap.String("host", host), zap.Strings("addresses", last), zap.Error(err))
				ips = last
			} else {
				errs = append(errs, fmt.Errorf("resolve %s: %w", host, err))
				continue
			}
		} else {
			if c.resolved == nil {
				c.resolved = map[string][]string{}
			}
			c.resolved[host] = ips
			c.savePeers()
		}
		for _, ip := range ips {
			out = append(out, net.JoinHostPort(ip, port))
		}
	}
	return out, errors.Join(errs...)
}

// lookupWithFallback bounds a DNS lookup of a name the collector has
// addresses for already.
const lookupWithFallback = 3 * time.Second

// keptPeers bounds the addresses a collector keeps, besides those of the
// latest list of replicas, from lists before it.
const keptPeers = 4

// LearnPeers keeps the aggregator replicas' addresses the aggregator sent
// as what each aggregator name resolves to, for when it cannot be
// resolved: a rollout during a DNS outage replaces every replica, and the
// collector has heard of the new ones while connected to the old. The
// latest list goes first, and up to keptPeers addresses it lacks from
// before stay after it: replicas' lists are not ordered, and one whose
// copy of the Service is behind (an old follower answering a hello) must
// not make the collector forget the successor a going replica named.
// DNS, when it answers, replaces the whole list.
func (c *client) LearnPeers(p *stream.Peers) {
	if p == nil {
		return
	}
	if err := p.Check(); err != nil {
		c.cfg.Log.Warn("ignoring the aggregator's list of replicas", zap.Error(err))
		return
	}
	for _, a := range strings.Split(c.cfg.Aggregator, ",") {
		host, _, err := net.SplitHostPort(strings.TrimSpace(a))
		if err != nil || net.ParseIP(host) != nil {
			continue
		}
		if c.resolved == nil {
			c.resolved = map[string][]string{}
		}
		before := c.resolved[host]
		ips := slices.Clone(p.IPs)
		kept := 0
		for _, ip := range before {
			if kept < keptPeers && !slices.Contains(ips, ip) {
				ips = append(ips, ip)
				kept++
			}
		}
		if !slices.Equal(slices.Sorted(slices.Values(before)), slices.Sorted(slices.Values(ips))) { // DNS answers in any order
			c.cfg.Log.Info("the aggregator named its replicas: dialed when the name cannot be resolved", zap.String("host", host),
				zap.Strings("addresses", p.IPs), zap.Strings("also_kept", ips[len(p.IPs):]))
		}
		c.resolved[host] = ips
	}
	c.savePeers()
}

// Token reads the projected ServiceAccount token ("" without a file).
func (c *client) Token() (string, error) {
	if c.cfg.TokenFile == "" {
		return "", nil
	}
	b, err := os.ReadFile(c.cfg.TokenFile)
	if err != nil {
		return "", fmt.Errorf("read the token: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// dial connects to the first aggregator address that answers, the
// preferred first, re-reading the CA bundle before each TLS dial (it is
// rotated in place).
func (c *client) dial(ctx context.Context, preferred string) (net.Conn, error) {
	addrs, err := c.addresses(ctx, preferred)
	if len(addrs) == 0 {
		return nil, err
	}
	var errs []error
	for _, a := range addrs {
		d := net.Dialer{Timeout: 5 * time.Second}
		var conn net.Conn
		if c.cfg.TLS != nil {
			if c.cfg.CAFile != "" {
				if pool, err := tlsfile.LoadCA(c.cfg.CAFile); err == nil {
					c.cfg.TLS = c.cfg.TLS.Clone()
					c.cfg.TLS.RootCAs = pool
				} else {
					c.cfg.Log.Warn("cannot re-read the CA bundle: verifying with the one read before", zap.Error(err))
				}
			}
			conn, err = (&tls.Dialer{NetDialer: &d, Config: c.cfg.TLS}).DialContext(ctx, "tcp", a)
		} else if c.cfg.Dial != nil {
			conn, err = c.cfg.Dial(ctx, a)
		} else {
			conn, err = d.DialContext(ctx, "tcp", a)
		}
		if err == nil {
			return conn, nil
		}
		errs = append(errs, err)
	}
	return nil, fmt.Errorf("no aggregator reachable: %w", errors.Join(errs...))
}

// greet sends the hello on conn and reads the answer: a session when the
// aggregator welcomed the stream, else the leader it named or why it
// refused.
func (c *client) greet(conn net.Conn) (*session, string, error) {
	token, err := c.Token()
	if err != nil {
		return nil, "", err
	}
	hello := &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{
		Node: c.cfg.Node, Token: token, Version: c.cfg.Version, IntervalSeconds: c.cfg.Interval.Seconds(), Refs: true, Tops: true}}
	if err := stream.Write(conn, hello); err != nil {
		return nil, "", err
	}
	conn.SetReadDeadline(time.Now().Add(15 * time.Second))
	reply, _, err := stream.Read(conn, c.cfg.MaxMessageBytes)
	if err != nil {
		return nil, "", fmt.Errorf("waiting for the aggregator's answer: %w", err)
	}
	conn.SetReadDeadline(time.Time{})
	// A follower's answer names the replicas too: while the Lease still
	// names a leader that is gone, a rollout can replace the follower
	// before this collector reaches any leader.
	if reply.Peers != nil {
		c.LearnPeers(reply.Peers)
	}
	if leader, err := HelloOutcome(reply); leader != "" || err != nil {
		return nil, leader, err
	}
	c.welcomed = true
	s := newSession(c, hello.Hello, reply, Stream{Interval: c.cfg.Interval, Clock: c.cfg.Clock, Log: c.cfg.Log})
	c.lastKP, c.ctSent = nil, 0
	c.cfg.Log.Info("streaming to the aggregator", zap.String("aggregator", conn.RemoteAddr().String()), zap.Bool("refs", s.refs), zap.Bool("tops", s.tops))
	return s, "", nil
}
