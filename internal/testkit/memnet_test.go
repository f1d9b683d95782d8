package testkit_test

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

// Both ends may write before either reads (a socket's buffers), a read
// deadline passes on the bubble's clock, and a close reads as EOF after
// what was written.
func TestMemNetBehavesLikeASocket(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mn := testkit.NewMemNet()
		ln, err := mn.Listen("127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		if _, err := mn.Dial(context.Background(), "127.0.0.1:1"); err == nil {
			t.Fatal("dialled an address nobody listens at")
		}
		client, err := mn.Dial(context.Background(), ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		server, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := server.RemoteAddr().(*net.TCPAddr); !ok {
			t.Errorf("remote address %T, want *net.TCPAddr", server.RemoteAddr())
		}
		big := strings.Repeat("x", 1<<20)
		for _, c := range []net.Conn{client, server} {
			if _, err := io.WriteString(c, big); err != nil {
				t.Fatalf("a buffered write: %v", err)
			}
		}
		start := time.Now()
		server.SetReadDeadline(start.Add(3 * time.Second))
		if b, err := io.ReadAll(io.LimitReader(server, 1<<20)); err != nil || len(b) != 1<<20 {
			t.Fatalf("read %d bytes: %v", len(b), err)
		}
		if _, err := server.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("a read past its deadline: %v", err)
		}
		if waited := time.Since(start); waited != 3*time.Second {
			t.Errorf("the deadline passed after %s of the bubble's time, want 3s", waited)
		}
		server.Close()
		if b, err := io.ReadAll(client); err != nil || len(b) != 1<<20 {
			t.Fatalf("after the server closed, read %d bytes, %v: want what it wrote, then EOF", len(b), err)
		}
		if _, err := client.Write([]byte("x")); err == nil {
			t.Error("a write to a closed peer succeeded")
		}
	})
}
