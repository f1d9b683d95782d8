package collector

import (
	"sync"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/audit"
)

// chainNotes learns from the change signal's notifications which chains
// of iptables-nft's nat tables each commit touched (NEWRULE, DELRULE,
// NEWCHAIN, DELCHAIN name them), so that a read dumps only those. What it
// cannot vouch for makes the next read whole: a lost notification
// (ENOBUFS), a nat table made or deleted, more touched chains than a read
// dumps one by one, and any time without a working subscription.
type chainNotes struct {
	mu         sync.Mutex
	subscribed bool
	lost       bool
	fams       [2]famNotes
	// gen is the generation of the last commit announced.
	gen uint32
}

type famNotes struct {
	reset  bool
	chains map[string]struct{}
}

// touched is what notes held when a read took them.
type touched struct {
	lost bool
	fams [2]famNotes
}

var _ NotificationSink = (*chainNotes)(nil)

// Note takes one notification: only the nat tables of ip and ip6, and of
// them only chains the audit reads.
func (n *chainNotes) Note(typ uint16, data []byte) {
	if len(data) < 4 || typ>>8 != unix.NFNL_SUBSYS_NFTABLES {
		return
	}
	if typ&0xff == unix.NFT_MSG_NEWGEN {
		if g, ok := genID(data); ok {
			n.mu.Lock()
			n.gen = g
			n.mu.Unlock()
		}
		return
	}
	i := 0
	switch data[0] {
	case unix.NFPROTO_IPV4:
	case unix.NFPROTO_IPV6:
		i = 1
	default:
		return
	}
	var table, chain string
	switch typ & 0xff {
	case unix.NFT_MSG_NEWRULE, unix.NFT_MSG_DELRULE, nftMsgDestroyRule:
		table, chain = ruleChainOf(data)
	case unix.NFT_MSG_NEWCHAIN, unix.NFT_MSG_DELCHAIN, nftMsgDestroyChain:
		table, chain = chainOf(data)
	case unix.NFT_MSG_NEWTABLE, unix.NFT_MSG_DELTABLE, nftMsgDestroyTable:
		if tableName(data) == "nat" {
			n.mu.Lock()
			n.fams[i].reset, n.fams[i].chains = true, nil
			n.mu.Unlock()
		}
		return
	default:
		return
	}
	if table != "nat" || !audit.Reads(chain) {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.touchLocked(i, chain)
}

func (n *chainNotes) touchLocked(i int, chain string) {
	f := &n.fams[i]
	if f.reset {
		return
	}
	if _, ok := f.chains[chain]; ok {
		return
	}
	if len(f.chains) >= maxChainReads {
		// A whole read costs less than this many chains one by one.
		f.reset, f.chains = true, nil
		return
	}
	if f.chains == nil {
		f.chains = map[string]struct{}{}
	}
	f.chains[chain] = struct{}{}
}

// touch marks a chain to be read again next time.
func (n *chainNotes) touch(fam int, chain string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	i := 0
	if fam == 6 {
		i = 1
	}
	n.touchLocked(i, chain)
}

// Lost: a notification was dropped; the next read is whole.
func (n *chainNotes) Lost() {
	n.mu.Lock()
	n.lost = true
	n.mu.Unlock()
}

// Subscribed says whether notifications flow: without them every read is
// whole.
func (n *chainNotes) Subscribed(on bool) {
	n.mu.Lock()
	n.subscribed, n.lost = on, true
	n.mu.Unlock()
}

// lastGen is the generation of the last commit announced.
func (n *chainNotes) lastGen() uint32 {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.gen
}

// take returns what was touched since the last take and starts afresh.
func (n *chainNotes) take() touched {
	n.mu.Lock()
	defer n.mu.Unlock()
	t := touched{lost: n.lost || !n.subscribed, fams: n.fams}
	n.lost = false
	n.fams = [2]famNotes{}
	return t
}

// Message types newer than golang.org/x/sys knows (Linux 6.3's destroy
// commands; the kernel announces them as deletions, taken here anyway).
const (
	nftMsgDestroyTable = 26
	nftMsgDestroyChain = 27
	nftMsgDestroyRule  = 28
)

// ruleChainOf reads a rule message's table and chain.
func ruleChainOf(data []byte) (table, chain string) {
	a, err := body(data, "rule")
	if err != nil {
		return "", ""
	}
	for a.next() {
		switch a.typ {
		case unix.NFTA_RULE_TABLE:
			table = a.str()
		case unix.NFTA_RULE_CHAIN:
			chain = a.str()
		}
		if table != "" && chain != "" {
			break
		}
	}
	return table, chain
}
