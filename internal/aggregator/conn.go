package aggregator

import (
	"io"
	"net"
	"sync"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// conn is one collector's stream: its connection, and the lock that keeps
// its writes whole (a message is written by one goroutine at a time).
type conn struct {
	net.Conn
	wmu sync.Mutex
	// authenticated leaves the count of connections not past their hello.
	authenticated func()
}

func (c *conn) send(m *stream.Message) (int, error) {
	return c.sendNewest(func() *stream.Message { return m })
}

// sendNewest sends the message m returns when this connection's turn to
// write comes: of two sends racing, the later carries the newer message.
func (c *conn) sendNewest(newest func() *stream.Message) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return c.writeLocked(newest())
}

// writeLocked writes m; the caller holds wmu.
func (c *conn) writeLocked(m *stream.Message) (int, error) {
	c.SetWriteDeadline(time.Now().Add(10 * time.Second))
	cw := &countingWriter{w: c.Conn}
	err := stream.Write(cw, m)
	return cw.n, err
}

type countingWriter struct {
	w io.Writer
	n int
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += n
	return n, err
}
