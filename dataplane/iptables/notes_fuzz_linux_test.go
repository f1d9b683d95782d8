//go:build linux

package iptables

import (
	"encoding/binary"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl/nltest"
)

// A hostile process with NET_ADMIN in the node's namespace can send any
// sequence of nf_tables notifications (four forged ones, a rule with
// handle 0 among them, made the KUBE-SERVICES mirror dereference a
// missing rule at every restart: trust review 4, item 7). Whatever the
// sequence: no panic, and the mirror's rules are what it holds.
func FuzzChainNotes(f *testing.F) {
	// Appended rules, one inserted after another, a deletion, a read.
	f.Add([]byte{0, 0, 5, 0, 0, 0x41, 0, 6, 0, 5, 2, 0, 5, 0, 0, 3, 0, 0, 0, 0, 5, 0, 0, 0, 0})
	// Rule 0 after rule 10, rule 11 deleted, rule 12 appended, rule 0
	// deleted: the sequence that walked off the list.
	f.Add([]byte{0x41, 0, 0, 0, 10, 2, 0, 11, 0, 0, 0, 0, 12, 0, 0, 2, 0, 0, 0, 0, 5, 0, 0, 0, 0})
	// Handle 0, and rules placed after it.
	f.Add([]byte{0, 0, 0, 0, 0, 0x41, 0, 7, 0, 0, 0, 0, 5, 0, 0, 0x41, 0, 8, 0, 7, 2, 0, 0, 0, 0, 5, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, ops []byte) {
		var n chainNotes
		n.Subscribed(true)
		// KUBE-SERVICES as a dump left it: rules 10 and 11.
		mirrors := map[string]*ruleMirror{"KUBE-SERVICES": mirrorOf([]Rule{{Jump: "KUBE-SVC-A"}, {Jump: "KUBE-SVC-B"}}, []uint64{10, 11})}
		for len(ops) >= 5 {
			kind, fam := (ops[0]&0x0f)%7, byte(unix.NFPROTO_IPV4)
			if ops[0]&0x80 != 0 {
				fam = unix.NFPROTO_IPV6
			}
			handle, pos, hasPos := uint64(binary.BigEndian.Uint16(ops[1:])), uint64(binary.BigEndian.Uint16(ops[3:])), ops[0]&0x40 != 0
			ops = ops[5:]
			switch kind {
			case 0:
				n.Note(nltest.MsgType(unix.NFT_MSG_NEWRULE), unix.NLM_F_APPEND, nltest.NATRuleNote(fam, handle, pos, hasPos))
			case 1:
				n.Note(nltest.MsgType(unix.NFT_MSG_NEWRULE), 0, nltest.NATRuleNote(fam, handle, pos, hasPos))
			case 2:
				n.Note(nltest.MsgType(unix.NFT_MSG_DELRULE), 0, nltest.NATRuleNote(fam, handle, 0, false))
			case 3:
				n.Note(nltest.MsgType(unix.NFT_MSG_NEWGEN), 0, nltest.GenMsg)
			case 4:
				n.Note(nltest.MsgType(unix.NFT_MSG_DELTABLE), 0, nltest.TableMsg("nat"))
			case 5:
				// A read takes the notes and applies the mirrored chains'.
				tk := n.take()
				for i := range tk.fams {
					for chain, m := range applyOps(mirrors, tk.fams[i].ops) {
						if m != nil {
							if r := m.rules(); len(r) > len(m.nodes) {
								t.Fatalf("%s: %d rules from %d nodes", chain, len(r), len(m.nodes))
							}
						}
					}
				}
			case 6:
				n.Lost()
			}
		}
		tk := n.take()
		for i := range tk.fams {
			applyOps(mirrors, tk.fams[i].ops)
		}
		for _, m := range mirrors {
			_ = m.rules()
		}
	})
}
