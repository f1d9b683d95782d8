package nftables

import (
	"slices"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// nftTouched learns from the change signal's notifications what each
// commit touched in kube-proxy's nftables tables: the chains whose rules
// changed (NEWRULE, DELRULE, NEWCHAIN, DELCHAIN), whether a named map the
// audit reads changed (its elements), and the sets made and deleted (an
// anonymous map's name and handle, so that a read can tell a cached map
// from a new one without listing every set). What it cannot vouch for
// makes the next read whole, as chainNotes does for iptables-nft.
type nftTouched struct {
	nl.Notes
	fams [2]nftFamTouched
}

type nftFamTouched struct {
	reset  bool
	maps   bool
	chains map[string]struct{}
	// sets made (handle, anonymous) and deleted, in order.
	sets []setChange
}

type setChange struct {
	name string
	info SetInfo
	gone bool
}

// flushedChains: past this many chains touched by a flush, the next read
// is whole.
const flushedChains = 64

// maxTouchedSets bounds the set changes kept between two reads (a
// kube-proxy sync makes and deletes one anonymous map per service it
// rewrites); past it the next read is whole.
const maxTouchedSets = 64 << 10

func (n *nftTouched) Note(typ, _ uint16, data []byte) {
	msg, i, ok := n.Family(typ, data)
	if !ok {
		return
	}
	switch msg {
	case unix.NFT_MSG_NEWRULE, unix.NFT_MSG_DELRULE, nl.MsgDestroyRule:
		table, chain, _ := nl.RuleChainOf(data)
		if string(table) == kubeProxyTable {
			if string(chain) == "services" {
				n.CountDispatch(i, msg)
			}
			n.touch(i, string(chain))
		}
	case unix.NFT_MSG_NEWCHAIN, unix.NFT_MSG_DELCHAIN, nl.MsgDestroyChain:
		if table, chain := nl.ChainOf(data); table == kubeProxyTable {
			n.touch(i, chain)
		}
	case unix.NFT_MSG_NEWSET, unix.NFT_MSG_DELSET, nl.MsgDestroySet:
		table, name, info, err := DecodeSetNote(data)
		if err != nil || table != kubeProxyTable {
			return
		}
		n.Lock()
		defer n.Unlock()
		f := &n.fams[i]
		if slices.Contains(nftNamedMaps, name) {
			f.maps = true
		}
		if f.reset {
			return
		}
		if len(f.sets) >= maxTouchedSets {
			f.reset, f.chains, f.sets = true, nil, nil
			return
		}
		f.sets = append(f.sets, setChange{name: name, info: info, gone: msg != unix.NFT_MSG_NEWSET})
	case unix.NFT_MSG_NEWSETELEM, unix.NFT_MSG_DELSETELEM, nl.MsgDestroySetElem:
		if table, set := ElemsOf(data); table == kubeProxyTable && slices.Contains(nftNamedMaps, set) {
			n.Lock()
			n.fams[i].maps = true
			n.Unlock()
		}
	case unix.NFT_MSG_NEWTABLE, unix.NFT_MSG_DELTABLE, nl.MsgDestroyTable:
		if nl.TableName(data) == kubeProxyTable {
			n.Lock()
			n.fams[i] = nftFamTouched{reset: true}
			if msg != unix.NFT_MSG_NEWTABLE {
				n.Flush.TableGone(i)
			}
			n.Unlock()
		}
	}
}

func (n *nftTouched) touch(i int, chain string) {
	n.Lock()
	defer n.Unlock()
	f := &n.fams[i]
	if f.reset {
		return
	}
	if _, ok := f.chains[chain]; ok {
		return
	}
	if len(f.chains) >= nl.MaxChainReads {
		f.reset, f.chains, f.sets = true, nil, nil
		return
	}
	if f.chains == nil {
		f.chains = map[string]struct{}{}
	}
	f.chains[chain] = struct{}{}
}

// take returns what was touched since the last take (see taken).
func (n *nftTouched) take() (lost bool, through uint64, fams [2]nftFamTouched) {
	n.Lock()
	defer n.Unlock()
	flushed := n.Flush.Tripped
	lost, through = n.Taken()
	fams = n.fams
	for i := range fams {
		if flushed && len(fams[i].chains) > flushedChains {
			// The table was flushed: one dump of it (its rules are gone)
			// costs less than each emptied chain's (2,500 at 2,500
			// services: most of a second).
			fams[i].reset = true
		}
	}
	n.fams = [2]nftFamTouched{}
	return lost, through, fams
}
