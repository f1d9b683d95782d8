package iptables

import (
	"bytes"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// chainNotes learns from the change signal's notifications which chains
// of iptables-nft's nat tables each commit touched (NEWRULE, DELRULE,
// NEWCHAIN, DELCHAIN name them), so that a read dumps only those. Of the
// mirrored chains (KUBE-SERVICES and KUBE-NODEPORTS: kube-proxy rewrites
// them whole at every sync, and they grow with the cluster) it keeps the
// changes themselves, each rule decoded, so that a read applies them
// instead of dumping 10k rules again. What it cannot vouch for makes the
// next read whole: a lost notification (ENOBUFS), a nat table made or
// deleted, more touched chains or changes than a read should apply one by
// one, and any time without a working subscription.
type chainNotes struct {
	nl.Notes
	fams [2]famNotes
}

type famNotes struct {
	reset  bool
	chains map[string]struct{}
	// ops are the changes of the mirrored chains, in commit order.
	ops []ruleOp
}

// ruleOp is one notified change of a mirrored chain.
type ruleOp struct {
	kind   uint8
	chain  string
	handle uint64
	// Where a new rule goes: after the rule with handle pos, else at the
	// end (appended) or at the start.
	pos      uint64
	hasPos   bool
	appended bool
	rule     Rule
	// err: the rule could not be decoded (the chain is dumped instead,
	// and falls back to the text tool if that fails too).
	err error
}

const (
	opNewRule = iota + 1
	opDelRule
	opNewChain
	opDelChain
)

// mirrored reports whether the notes keep chain's changes themselves.
func mirrored(chain string) bool { return chain == "KUBE-SERVICES" || chain == "KUBE-NODEPORTS" }

// maxMirrorOps bounds the changes of mirrored chains kept between two
// reads: three of kube-proxy's syncs at 10k services (each deletes and
// adds every KUBE-SERVICES rule). Past it, the chain is dumped instead.
const maxMirrorOps = 64 << 10

// touched is what notes held when a read took them.
type touched struct {
	lost    bool
	through uint64
	fams    [2]famNotes
}

// Note takes one notification: only the nat tables of ip and ip6, and of
// them only chains the audit reads.
func (n *chainNotes) Note(typ, flags uint16, data []byte) {
	msg, i, ok := n.Family(typ, data)
	if !ok {
		return
	}
	// Names as views into the message: most notifications are of chains
	// the audit does not read, or of the mirrored ones.
	var table, chain []byte
	var handle uint64
	switch msg {
	case unix.NFT_MSG_NEWRULE, unix.NFT_MSG_DELRULE, nl.MsgDestroyRule:
		table, chain, handle = nl.RuleChainOf(data)
	case unix.NFT_MSG_NEWCHAIN, unix.NFT_MSG_DELCHAIN, nl.MsgDestroyChain:
		t, c := nl.ChainOf(data)
		table, chain = []byte(t), []byte(c)
	case unix.NFT_MSG_NEWTABLE, unix.NFT_MSG_DELTABLE, nl.MsgDestroyTable:
		if nl.TableName(data) == "nat" {
			n.Lock()
			n.fams[i].reset, n.fams[i].chains, n.fams[i].ops = true, nil, nil
			if msg != unix.NFT_MSG_NEWTABLE {
				n.Flush.TableGone(i)
			}
			n.Unlock()
		}
		return
	default:
		return
	}
	if string(table) != "nat" || !reads(chain) {
		return
	}
	if string(chain) == "KUBE-SERVICES" {
		n.CountDispatch(i, msg)
	}
	if string(chain) == "KUBE-SERVICES" || string(chain) == "KUBE-NODEPORTS" {
		op := ruleOp{chain: mirroredName(string(chain))}
		switch msg {
		case unix.NFT_MSG_NEWRULE:
			// Decoded here, off the read: at 10k services a sync adds 10k
			// rules to KUBE-SERVICES, a few MB of messages.
			d, err := DecodeNFTRule(data, 4+2*i)
			op.kind, op.handle, op.pos, op.hasPos, op.rule, op.err = opNewRule, d.Handle, d.Position, d.HasPosition, d.Rule, err
			op.appended = flags&unix.NLM_F_APPEND != 0
		case unix.NFT_MSG_DELRULE, nl.MsgDestroyRule:
			op.kind, op.handle = opDelRule, handle
		case unix.NFT_MSG_NEWCHAIN:
			op.kind = opNewChain
		default:
			op.kind = opDelChain
		}
		n.Lock()
		defer n.Unlock()
		f := &n.fams[i]
		if f.reset {
			return
		}
		if len(f.ops) >= maxMirrorOps {
			// Dumped instead: at 10k services KUBE-SERVICES costs 65 ms.
			ops := f.ops[:0]
			for _, o := range f.ops {
				if o.chain != op.chain {
					ops = append(ops, o)
				}
			}
			f.ops = ops
			n.touchLocked(i, op.chain)
			return
		}
		if _, dump := f.chains[op.chain]; dump {
			return // the chain is dumped at the next read anyway
		}
		f.ops = append(f.ops, op)
		return
	}
	n.Lock()
	defer n.Unlock()
	n.touchLocked(i, string(chain))
}

// reads is Reads of a name in bytes.
func reads(chain []byte) bool {
	return bytes.HasPrefix(chain, []byte("KUBE-")) && Reads(string(chain))
}

// mirroredName returns the constant string of a mirrored chain's name, so
// that each change does not keep its own copy.
func mirroredName(chain string) string {
	if chain == "KUBE-SERVICES" {
		return "KUBE-SERVICES"
	}
	return "KUBE-NODEPORTS"
}

func (n *chainNotes) touchLocked(i int, chain string) {
	f := &n.fams[i]
	if f.reset {
		return
	}
	if _, ok := f.chains[chain]; ok {
		return // (a lookup by a converted name does not allocate)
	}
	if len(f.chains) >= nl.MaxChainReads {
		// A whole read costs less than this many chains one by one.
		f.reset, f.chains, f.ops = true, nil, nil
		return
	}
	if f.chains == nil {
		f.chains = map[string]struct{}{}
	}
	f.chains[chain] = struct{}{}
}

// touch marks a chain to be read again next time.
func (n *chainNotes) touch(fam int, chain string) {
	n.Lock()
	defer n.Unlock()
	i := 0
	if fam == 6 {
		i = 1
	}
	n.touchLocked(i, chain)
}

// take returns what was touched since the last take and starts afresh.
func (n *chainNotes) take() touched {
	n.Lock()
	defer n.Unlock()
	t := touched{fams: n.fams}
	t.lost, t.through = n.Taken()
	n.fams = [2]famNotes{}
	return t
}

// applyOps applies the mirrored chains' notified changes to their
// mirrors, and returns each chain they touched: its mirror, or nil when
// the changes did not apply and the chain must be dumped (its later
// changes in this batch are then not applied: the dump shows them).
func applyOps(mirrors map[string]*ruleMirror, ops []ruleOp) map[string]*ruleMirror {
	out := map[string]*ruleMirror{}
	for _, op := range ops {
		if m, ok := out[op.chain]; ok && m == nil {
			continue
		}
		m := mirrors[op.chain]
		switch op.kind {
		case opNewChain:
			if m == nil {
				m = newRuleMirror()
				mirrors[op.chain] = m
			}
		case opDelChain:
			// Gone: no rules (a chain made again starts empty).
			delete(mirrors, op.chain)
			m = newRuleMirror()
		case opNewRule:
			if m == nil {
				// A chain that was there, empty, when the table was read.
				m = newRuleMirror()
				mirrors[op.chain] = m
			}
			if op.err != nil || !m.add(op.handle, op.pos, op.hasPos, op.appended, op.rule) {
				out[op.chain] = nil
				continue
			}
		case opDelRule:
			if m != nil {
				m.del(op.handle)
			}
		}
		if m != nil {
			out[op.chain] = m
		}
	}
	return out
}
