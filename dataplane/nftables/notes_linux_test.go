//go:build linux

package nftables

import (
	"math"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl/nltest"
)

const anon = unix.NFT_SET_ANONYMOUS | unix.NFT_SET_CONSTANT | unix.NFT_SET_MAP

// A map's elements are believed only from a commit that closed (NEWGEN)
// with every notification received; anything doubtful is left to a dump.
func TestMapNotesBelieveOnlyWholeCommits(t *testing.T) {
	fam := byte(unix.NFPROTO_IPV4)
	commit := func(m *mapNotes, name string, handle uint64, close bool) {
		m.Note(nltest.MsgType(unix.NFT_MSG_NEWSET), 0, nltest.SetMsg("kube-proxy", name, handle, anon))
		m.Note(nltest.MsgType(unix.NFT_MSG_NEWSETELEM), 0, nltest.SetElemMsg("kube-proxy", name, 0, "endpoint-a"))
		m.Note(nltest.MsgType(unix.NFT_MSG_NEWSETELEM), 0, nltest.SetElemMsg("kube-proxy", name, 1, "endpoint-b"))
		if close {
			m.Note(nltest.MsgType(unix.NFT_MSG_NEWGEN), 0, nltest.GenMsg)
		}
	}
	t.Run("whole commit", func(t *testing.T) {
		var m mapNotes
		commit(&m, "__map0", 7, true)
		lm, ok := m.take(fam, 7)
		if !ok || lm == nil || len(lm.Targets) != 2 || lm.Targets[0] != "endpoint-a" || lm.Targets[1] != "endpoint-b" {
			t.Fatalf("take = %+v, %v; want both elements", lm, ok)
		}
		if _, ok := m.take(fam, 7); ok {
			t.Error("a map was handed out twice")
		}
	})
	t.Run("commit not closed yet", func(t *testing.T) {
		var m mapNotes
		commit(&m, "__map0", 7, false)
		if _, ok := m.take(fam, 7); ok {
			t.Error("elements of an open commit were believed")
		}
	})
	t.Run("notification lost mid-commit", func(t *testing.T) {
		var m mapNotes
		m.Note(nltest.MsgType(unix.NFT_MSG_NEWSET), 0, nltest.SetMsg("kube-proxy", "__map0", 7, anon))
		m.Note(nltest.MsgType(unix.NFT_MSG_NEWSETELEM), 0, nltest.SetElemMsg("kube-proxy", "__map0", 0, "endpoint-a"))
		m.Lost()
		m.Note(nltest.MsgType(unix.NFT_MSG_NEWSETELEM), 0, nltest.SetElemMsg("kube-proxy", "__map0", 1, "endpoint-b"))
		m.Note(nltest.MsgType(unix.NFT_MSG_NEWGEN), 0, nltest.GenMsg)
		if _, ok := m.take(fam, 7); ok {
			t.Error("a map with a lost notification was believed")
		}
	})
	t.Run("lost after the commit", func(t *testing.T) {
		var m mapNotes
		commit(&m, "__map0", 7, true)
		m.Lost()
		if _, ok := m.take(fam, 7); ok {
			t.Error("what was learnt before an overrun survived it")
		}
	})
	t.Run("table made again", func(t *testing.T) {
		var m mapNotes
		commit(&m, "__map0", 7, true)
		m.Note(nltest.MsgType(unix.NFT_MSG_DELTABLE), 0, nltest.TableMsg("kube-proxy"))
		if _, ok := m.take(fam, 7); ok {
			t.Error("a map of a deleted table answers for a new table's handle")
		}
	})
	t.Run("other tables, named sets", func(t *testing.T) {
		var m mapNotes
		m.Note(nltest.MsgType(unix.NFT_MSG_NEWSET), 0, nltest.SetMsg("filter", "__map0", 7, anon))
		m.Note(nltest.MsgType(unix.NFT_MSG_NEWSETELEM), 0, nltest.SetElemMsg("filter", "__map0", 0, "x"))
		m.Note(nltest.MsgType(unix.NFT_MSG_NEWSET), 0, nltest.SetMsg("kube-proxy", "service-ips", 8, unix.NFT_SET_MAP))
		m.Note(nltest.MsgType(unix.NFT_MSG_NEWSETELEM), 0, nltest.SetElemMsg("kube-proxy", "service-ips", 0, "x"))
		m.Note(nltest.MsgType(unix.NFT_MSG_NEWGEN), 0, nltest.GenMsg)
		if _, ok := m.take(fam, 7); ok {
			t.Error("another table's map was taken for kube-proxy's")
		}
		if _, ok := m.take(fam, 8); ok {
			t.Error("a named map (its elements change) was noted")
		}
	})
	t.Run("deleted, and seen by a read", func(t *testing.T) {
		var m mapNotes
		commit(&m, "__map0", 7, true)
		commit(&m, "__map1", 9, true)
		m.Note(nltest.MsgType(unix.NFT_MSG_DELSET), 0, nltest.SetMsg("kube-proxy", "__map0", 7, anon))
		if _, ok := m.take(fam, 7); ok {
			t.Error("a deleted map was handed out")
		}
		m.seen(fam, 9)
		if len(m.done) != 0 || m.elems != 0 {
			t.Errorf("after a read saw handles up to 9: %d maps, %d elements kept", len(m.done), m.elems)
		}
	})
}

// Hostile or garbled notifications: no panic, and never more than the
// bound held.
func FuzzMapNotes(f *testing.F) {
	f.Add(uint16(unix.NFT_MSG_NEWSET), nltest.SetMsg("kube-proxy", "__map0", 7, anon), nltest.SetElemMsg("kube-proxy", "__map0", 0, "endpoint-a"))
	f.Add(uint16(unix.NFT_MSG_NEWSETELEM), []byte{2, 0, 0, 0, 4, 0}, []byte{})
	f.Fuzz(func(t *testing.T, typ uint16, a, b []byte) {
		var m mapNotes
		m.Note(nltest.MsgType(unix.NFT_MSG_NEWSET), 0, nltest.SetMsg("kube-proxy", "__map0", 7, anon))
		for range 3 {
			m.Note(nltest.MsgType(typ&0xff), 0, a)
			m.Note(nltest.MsgType(unix.NFT_MSG_NEWSETELEM), 0, b)
		}
		m.Note(nltest.MsgType(unix.NFT_MSG_NEWGEN), 0, nltest.GenMsg)
		if m.elems > maxNotedElems || m.elems < 0 {
			t.Fatalf("%d elements held", m.elems)
		}
		m.take(byte(unix.NFPROTO_IPV4), 7)
		// Every handle seen: a garbled announcement may carry any handle
		// (the bound was 1<<62, below which the fuzzer found one).
		m.seen(byte(unix.NFPROTO_IPV4), math.MaxUint64)
		m.seen(byte(unix.NFPROTO_IPV6), math.MaxUint64) // the reader reads both tables
		if m.elems != 0 {
			t.Fatalf("%d elements held after every map was seen", m.elems)
		}
	})
}
