// The iptables-nft reader's dumps: a family's nat table in one dump (up
// to a number of parts) and one chain's rules.

package iptables

import (
	"context"
	"errors"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// dumpTable reads a family's nat table's rules in one dump, of at most
// maxParts parts: when it stops there (errDumpStopped), last is the chain
// it was reading, which the model does not hold.
func (r *NFTReader) dumpTable(ctx context.Context, fam int, mirrors map[string]*ruleMirror, n *int64, maxParts int) (nat *NAT, last string, intr bool, err error) {
	nat = NewNAT(fam)
	var cur string
	var rules []Rule
	var handles []uint64
	var ferr error
	flush := func() {
		if cur != "" && ferr == nil {
			ferr = nat.SetChain(cur, rules)
			if mirrored(cur) {
				mirrors[cur] = mirrorOf(rules, handles)
			}
		}
		cur, rules, handles = "", rules[:0], handles[:0]
	}
	intr, err = r.dump(ctx, unix.NFT_MSG_GETRULE, fam, nl.Attr(unix.NFTA_RULE_TABLE, nl.CString("nat")), n, maxParts, func(body []byte) error {
		d, err := DecodeNFTRule(body, fam)
		if err != nil {
			return err
		}
		if string(d.Table) != "nat" {
			return nil
		}
		// A dump lists each chain's rules together.
		if string(d.Chain) != cur {
			flush()
			cur = string(d.Chain)
		}
		if !d.Skipped {
			rules, handles = append(rules, d.Rule), append(handles, d.Handle)
		}
		return nil
	})
	switch {
	case errors.Is(err, errDumpStopped):
		return nat, cur, intr, err
	case errors.Is(err, unix.ENOENT):
		return NewNAT(fam), "", false, nil
	case err != nil:
		return nil, "", false, err
	}
	if flush(); ferr != nil {
		return nil, "", false, ferr
	}
	return nat, "", intr, nil
}

// readChain dumps one chain's rules; ok is false when the chain (or the
// table) does not exist. A chain's dump interrupted by a commit is tried
// again; after a few tries its rules are taken as read, and the commit's
// notifications have it read again next time.
//
// The rules and handles returned are the reader's own, valid until its
// next readChain.
func (r *NFTReader) readChain(ctx context.Context, fam int, chain string, n *int64) ([]Rule, []uint64, bool, error) {
	rules, handles := r.chainRules[:0], r.chainHandles[:0]
	defer func() { r.chainRules, r.chainHandles = rules[:0], handles[:0] }()
	for try := 0; ; try++ {
		rules, handles = rules[:0], handles[:0]
		intr, err := r.dump(ctx, unix.NFT_MSG_GETRULE, fam,
			append(nl.Attr(unix.NFTA_RULE_TABLE, nl.CString("nat")), nl.Attr(unix.NFTA_RULE_CHAIN, nl.CString(chain))...), n, 0,
			func(body []byte) error {
				d, err := DecodeNFTRule(body, fam)
				if err != nil {
					return err
				}
				if string(d.Table) == "nat" && string(d.Chain) == chain {
					rules, handles = append(rules, d.Rule), append(handles, d.Handle)
				}
				return nil
			})
		switch {
		case errors.Is(err, unix.ENOENT):
			return nil, nil, false, nil
		case err != nil:
			return nil, nil, false, err
		case intr && try < nl.InterruptedTries:
			continue
		case intr:
			r.notes.touch(fam, chain)
		}
		return rules, handles, true, nil
	}
}
