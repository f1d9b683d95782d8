//go:build linux

package collector

import (
	"context"
	"encoding/binary"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl"
	"github.com/proxyaudit/proxyaudit/dataplane/nl/nltest"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// recordingSink keeps the notifications it is handed.
type recordingSink struct {
	mu    sync.Mutex
	types []uint16
}

func (r *recordingSink) Note(typ, _ uint16, _ []byte) {
	r.mu.Lock()
	r.types = append(r.types, typ&0xff)
	r.mu.Unlock()
}
func (r *recordingSink) Lost() {}

func (r *recordingSink) seen() []uint16 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]uint16(nil), r.types...)
}

// On a real kernel, in a namespace of the test's own: a user-space socket
// (CAP_NET_ADMIN there) sends nf_tables notifications to the group the
// collector listens to, a rule of handle 0 and a commit's end among them.
// The collector took them as the kernel's (trust review 4, item 7); now
// they never reach the readers and announce no change, while a genuine
// commit still does.
func TestE2EForgedNotificationsAreDropped(t *testing.T) {
	localcluster.NeedRoot(t, false)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ns, err := localcluster.NewScratch(ctx, "forged")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	sink := &recordingSink{}
	var sig *nl.GenSignal
	if err := localcluster.InNetNS(ns.NetNS, func() error {
		s, err := nl.OpenGenSignal(DefaultNotifyBuffer)
		if err != nil {
			return err
		}
		sig = s
		sig.Feed(sink)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	defer sig.Close()

	// The forger: a netlink socket of its own, sending to the group.
	send := func(typ uint16, body []byte) {
		t.Helper()
		if err := localcluster.InNetNS(ns.NetNS, func() error {
			fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			msg := make([]byte, unix.NLMSG_HDRLEN, unix.NLMSG_HDRLEN+len(body))
			msg = append(msg, body...)
			binary.NativeEndian.PutUint32(msg, uint32(len(msg)))
			binary.NativeEndian.PutUint16(msg[4:], unix.NFNL_SUBSYS_NFTABLES<<8|typ)
			return unix.Sendto(fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: 1 << (unix.NFNLGRP_NFTABLES - 1)})
		}); err != nil {
			t.Fatalf("the forger could not send: %v (the test proves nothing)", err)
		}
	}
	send(unix.NFT_MSG_NEWRULE, nltest.NATRuleNote(unix.NFPROTO_IPV4, 0, 10, true))
	send(unix.NFT_MSG_DELRULE, nltest.NATRuleNote(unix.NFPROTO_IPV4, 11, 0, false))
	send(unix.NFT_MSG_NEWRULE, nltest.NATRuleNote(unix.NFPROTO_IPV4, 12, 0, false))
	send(unix.NFT_MSG_NEWGEN, nltest.GenMsg)
	select {
	case <-sig.Events():
		t.Error("forged notifications announced a change")
	case <-time.After(500 * time.Millisecond):
	}
	if got := sink.seen(); len(got) != 0 {
		t.Errorf("the readers were handed forged notifications: types %v", got)
	}
	// A genuine commit is still seen.
	if out, err := ns.Exec(ctx, "iptables", "-t", "nat", "-N", "KUBE-SERVICES"); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	select {
	case <-sig.Events():
	case <-time.After(5 * time.Second):
		t.Fatal("a genuine commit announced nothing")
	}
	if len(sink.seen()) == 0 {
		t.Error("the genuine commit's notifications did not reach the readers")
	}
}
