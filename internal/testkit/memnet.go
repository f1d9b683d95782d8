package testkit

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"time"
)

// MemNet is a network in memory for tests run in a testing/synctest
// bubble, where a socket's wait is not one the bubble can see (a
// goroutine reading a loopback connection is never "durably blocked", so
// synctest.Wait would not return). Its connections buffer what is written
// like TCP (a write returns at once, up to MemBuffer unread bytes), honour
// deadlines on the bubble's clock, and block on sync.Cond, which a bubble
// sees. Create it inside the bubble.
type MemNet struct {
	mu        sync.Mutex
	listeners map[string]*memListener
	next      int
}

// MemBuffer is how many unread bytes one direction of a connection holds
// before a write waits for the reader, like a socket's buffers.
const MemBuffer = 4 << 20

// NewMemNet returns an empty network.
func NewMemNet() *MemNet { return &MemNet{listeners: map[string]*memListener{}} }

// Listen listens at addr ("host:port"; port 0 picks one).
func (n *MemNet) Listen(addr string) (net.Listener, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if port == "0" {
		n.next++
		port = strconv.Itoa(40000 + n.next)
	}
	addr = net.JoinHostPort(host, port)
	if n.listeners[addr] != nil {
		return nil, fmt.Errorf("listen %s: address in use", addr)
	}
	l := &memListener{n: n, key: addr, addr: memAddr(addr), backlog: make(chan net.Conn, 128), done: make(chan struct{})}
	n.listeners[addr] = l
	return l, nil
}

// Dial connects to the listener at addr, or fails as a refused connection.
func (n *MemNet) Dial(ctx context.Context, addr string) (net.Conn, error) {
	n.mu.Lock()
	l := n.listeners[addr]
	n.next++
	from := memAddr(net.JoinHostPort("127.0.0.1", strconv.Itoa(50000+n.next)))
	n.mu.Unlock()
	if l == nil {
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
	}
	client, server := memPipe(from, l.addr)
	select {
	case l.backlog <- server:
		return client, nil
	case <-l.done:
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// HTTPServer serves h on a new address of the network until the test
// ends; it returns the server's URL and a client that reaches it.
func (n *MemNet) HTTPServer(t interface{ Cleanup(func()) }, h http.Handler) (string, *http.Client) {
	ln, err := n.Listen("127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	srv := httptest.NewUnstartedServer(h)
	srv.Listener.Close()
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL, n.HTTPClient()
}

// HTTPClient is a client whose every connection is made on the network.
func (n *MemNet) HTTPClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext:       func(ctx context.Context, _, addr string) (net.Conn, error) { return n.Dial(ctx, addr) },
		DisableKeepAlives: true,
	}}
}

// memAddr is an address as TCP gives it (the aggregator counts
// connections by their source's IP).
func memAddr(s string) net.Addr {
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return net.TCPAddrFromAddrPort(ap)
	}
	return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)}
}

type memListener struct {
	n       *MemNet
	key     string
	addr    net.Addr
	backlog chan net.Conn
	done    chan struct{}
	once    sync.Once
}

func (l *memListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.backlog:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *memListener) Close() error {
	l.once.Do(func() {
		close(l.done)
		l.n.mu.Lock()
		delete(l.n.listeners, l.key)
		l.n.mu.Unlock()
	})
	return nil
}

func (l *memListener) Addr() net.Addr { return l.addr }

// memPipe is a connection's two ends: each writes into the other's
// inbound half.
func memPipe(a, b net.Addr) (net.Conn, net.Conn) {
	ab, ba := newHalf(), newHalf()
	return &memConn{in: ba, out: ab, local: a, remote: b}, &memConn{in: ab, out: ba, local: b, remote: a}
}

// half is one direction of a connection.
type half struct {
	mu       sync.Mutex
	cond     *sync.Cond
	buf      bytes.Buffer
	closed   bool // the writer closed: reads end at EOF once drained
	gone     bool // the reader closed: writes fail
	rdl, wdl deadline
}

type deadline struct {
	at    time.Time
	timer *time.Timer
}

func newHalf() *half {
	h := &half{}
	h.cond = sync.NewCond(&h.mu)
	return h
}

// set arms d to wake h's waiters at t (zero: never).
func (h *half) set(d *deadline, t time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if d.timer != nil {
		d.timer.Stop()
		d.timer = nil
	}
	d.at = t
	if !t.IsZero() {
		d.timer = time.AfterFunc(time.Until(t), func() {
			h.mu.Lock()
			h.cond.Broadcast()
			h.mu.Unlock()
		})
	}
	h.cond.Broadcast()
}

func past(d deadline) bool { return !d.at.IsZero() && !time.Now().Before(d.at) }

func (h *half) read(p []byte) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for h.buf.Len() == 0 {
		switch {
		case h.gone:
			return 0, net.ErrClosed
		case h.closed:
			return 0, io.EOF
		case past(h.rdl):
			return 0, os.ErrDeadlineExceeded
		}
		h.cond.Wait()
	}
	n, _ := h.buf.Read(p)
	h.cond.Broadcast()
	return n, nil
}

func (h *half) write(p []byte) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	written := 0
	for len(p) > 0 {
		switch {
		case h.closed:
			return written, net.ErrClosed
		case h.gone:
			return written, errors.New("write: connection reset by peer")
		case past(h.wdl):
			return written, os.ErrDeadlineExceeded
		}
		room := MemBuffer - h.buf.Len()
		if room <= 0 {
			h.cond.Wait()
			continue
		}
		k := min(room, len(p))
		h.buf.Write(p[:k])
		p, written = p[k:], written+k
		h.cond.Broadcast()
	}
	return written, nil
}

type memConn struct {
	in, out       *half
	local, remote net.Addr
	once          sync.Once
}

func (c *memConn) Read(p []byte) (int, error)  { return c.in.read(p) }
func (c *memConn) Write(p []byte) (int, error) { return c.out.write(p) }

func (c *memConn) Close() error {
	c.once.Do(func() {
		for _, h := range []*half{c.in, c.out} {
			h.mu.Lock()
			if h == c.in {
				h.gone = true
			} else {
				h.closed = true
			}
			for _, d := range []*deadline{&h.rdl, &h.wdl} {
				if d.timer != nil {
					d.timer.Stop()
				}
			}
			h.cond.Broadcast()
			h.mu.Unlock()
		}
	})
	return nil
}

func (c *memConn) LocalAddr() net.Addr  { return c.local }
func (c *memConn) RemoteAddr() net.Addr { return c.remote }
func (c *memConn) SetDeadline(t time.Time) error {
	c.SetReadDeadline(t)
	return c.SetWriteDeadline(t)
}
func (c *memConn) SetReadDeadline(t time.Time) error  { c.in.set(&c.in.rdl, t); return nil }
func (c *memConn) SetWriteDeadline(t time.Time) error { c.out.set(&c.out.wdl, t); return nil }
