// The nftables reader's dumps of kube-proxy's table: its named maps,
// sets, handle and a set's elements, and the dump itself (asked again
// when a commit interrupts it).

package nftables

import (
	"bytes"
	"context"
	"errors"
	"fmt"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// chainRules dumps one chain's rules (none: the chain is gone).
func (r *NetlinkReader) chainRules(ctx context.Context, fam byte, chain string, n *int64) ([]Rule, error) {
	r.chains.Add(1)
	var rules []Rule
	err := r.dump(ctx, unix.NFT_MSG_GETRULE, fam, []netlink.Attribute{{Type: unix.NFTA_RULE_TABLE, Data: nl.CString(kubeProxyTable)},
		{Type: unix.NFTA_RULE_CHAIN, Data: nl.CString(chain)}}, n, func(data []byte) error {
		rule, err := DecodeRule(data)
		if err == nil && rule.Chain == chain {
			rules = append(rules, rule)
		}
		return err
	})
	if errors.Is(err, unix.ENOENT) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("chain %s: %w", nl.Clip(chain), err)
	}
	return rules, nil
}

// rulesByChain reads the table's rules chain by chain, for a whole read
// whose one dump commits kept interrupting: the chains the audit reads
// (frontends' and the services dispatch), named by the chain list. A
// chain list can be interrupted too (a chain made or deleted between its
// parts); the names of every try are taken, so a chain one try skipped
// is named by another, and one made since is named by the notifications
// for the next read.
func (r *NetlinkReader) rulesByChain(ctx context.Context, fam byte, n *int64) (map[string][]Rule, error) {
	r.byChain.Add(1)
	names := map[string]struct{}{}
	list := func(data []byte) error {
		if table, chain := nl.ChainOf(data); table == kubeProxyTable && (chain == "services" || FrontendChain(chain)) {
			names[chain] = struct{}{}
		}
		return nil
	}
	for try := 0; ; try++ {
		err := r.dumpTries(ctx, 1, true, unix.NFT_MSG_GETCHAIN, fam, []netlink.Attribute{{Type: unix.NFTA_CHAIN_TABLE, Data: nl.CString(kubeProxyTable)}}, n, list)
		if err == nil || try+1 == nl.InterruptedTries && errors.Is(err, nl.ErrDumpInterrupted) {
			break
		}
		if !errors.Is(err, nl.ErrDumpInterrupted) {
			return nil, err
		}
	}
	rules := make(map[string][]Rule, len(names))
	for chain := range names {
		rs, err := r.chainRules(ctx, fam, chain, n)
		if err != nil {
			return nil, err
		}
		if rs != nil {
			rules[chain] = rs
		}
	}
	return rules, nil
}

// namedMaps dumps the named maps the audit reads (a map that is not there
// reads as empty).
func (r *NetlinkReader) namedMaps(ctx context.Context, fam byte, n *int64) (map[string][]Elem, error) {
	maps := map[string][]Elem{}
	for _, name := range nftNamedMaps {
		els, err := r.elements(ctx, fam, name, n)
		if err != nil && !errors.Is(err, unix.ENOENT) {
			return nil, fmt.Errorf("map %s: %w", name, err)
		}
		maps[name] = els
	}
	return maps, nil
}

// sets lists the table's sets with their handles.
func (r *NetlinkReader) sets(ctx context.Context, fam byte, n *int64) (map[string]SetInfo, error) {
	out := map[string]SetInfo{}
	err := r.dump(ctx, unix.NFT_MSG_GETSET, fam, []netlink.Attribute{{Type: unix.NFTA_SET_TABLE, Data: nl.CString(kubeProxyTable)}}, n,
		func(data []byte) error {
			name, info, err := DecodeSet(data)
			if err != nil {
				return err
			}
			out[name] = info
			return nil
		})
	return out, err
}

// handleOfTable is the handle of kube-proxy's table (ENOENT: no table).
func (r *NetlinkReader) handleOfTable(ctx context.Context, fam byte) (uint64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	body, err := netlink.MarshalAttributes([]netlink.Attribute{{Type: unix.NFTA_TABLE_NAME, Data: nl.CString(kubeProxyTable)}})
	if err != nil {
		return 0, err
	}
	msgs, err := r.conn.Execute(netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETTABLE), Flags: netlink.Request},
		Data:   append([]byte{fam, unix.NFNETLINK_V0, 0, 0}, body...),
	})
	if err != nil {
		return 0, err
	}
	for _, m := range msgs {
		if h, ok := TableHandle(m.Data); ok {
			return h, nil
		}
	}
	return 0, errors.New("no handle in the kernel's answer for the table")
}

// elements dumps one set's or map's elements.
func (r *NetlinkReader) elements(ctx context.Context, fam byte, set string, n *int64) ([]Elem, error) {
	var out []Elem
	err := r.dump(ctx, unix.NFT_MSG_GETSETELEM, fam, []netlink.Attribute{
		{Type: unix.NFTA_SET_ELEM_LIST_TABLE, Data: nl.CString(kubeProxyTable)},
		{Type: unix.NFTA_SET_ELEM_LIST_SET, Data: nl.CString(set)},
	}, n, func(data []byte) error {
		var err error
		out, err = DecodeElems(data, out)
		return err
	})
	return out, err
}

// dump sends one nf_tables dump request and hands each reply's body to
// fn. A dump the kernel flags interrupted by a commit (NLM_F_DUMP_INTR:
// it resumes a dump by position, so a commit between two parts can skip
// or repeat rules of chains it never touched) is asked again, up to
// nl.InterruptedTries times, and then fails with nl.ErrDumpInterrupted; fn
// sees only an answer that was not interrupted.
func (r *NetlinkReader) dump(ctx context.Context, msg uint16, fam byte, attrs []netlink.Attribute, n *int64, fn func([]byte) error) error {
	return r.dumpTries(ctx, nl.InterruptedTries, false, msg, fam, attrs, n, fn)
}

// dumpTries is dump with its number of tries; with keep, fn is handed the
// interrupted answers too (before the error).
func (r *NetlinkReader) dumpTries(ctx context.Context, tries int, keep bool, msg uint16, fam byte, attrs []netlink.Attribute, n *int64, fn func([]byte) error) error {
	body, err := netlink.MarshalAttributes(attrs)
	if err != nil {
		return err
	}
	req := netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | msg), Flags: netlink.Request | netlink.Dump},
		Data:   append([]byte{fam, unix.NFNETLINK_V0, 0, 0}, body...),
	}
	for try := 0; try < tries; try++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		sent, err := r.conn.Send(req)
		if err != nil {
			return err
		}
		bodies, intr, err := r.receiveDump(sent.Header.Sequence, n)
		if err != nil {
			return err
		}
		if intr {
			r.interrupted.Add(1)
			if !keep {
				continue
			}
		}
		for _, b := range bodies {
			if err := fn(b); err != nil {
				return err
			}
		}
		if !intr {
			return nil
		}
	}
	return nl.ErrDumpInterrupted
}

// dumpBuffer holds one datagram of a dump (the kernel's dump parts are at
// most a few pages).
const dumpBuffer = 256 << 10

// receiveDump reads the parts of dump seq up to the kernel's done message
// and returns the messages' bodies, and whether any part — the done
// message included — was flagged interrupted by a commit. The done
// message can be the only one flagged (a commit just before the dump's
// last, empty round, which resumed by position past the rules a commit
// moved: the table's last rules never came); the library's Receive drops
// it, flag and all, so the datagrams are read here (nl.Messages).
func (r *NetlinkReader) receiveDump(seq uint32, n *int64) (bodies [][]byte, intr bool, err error) {
	rc, err := r.conn.SyscallConn()
	if err != nil {
		return nil, false, err
	}
	if r.buf == nil {
		r.buf = make([]byte, dumpBuffer)
	}
	for {
		var size int
		var rerr error
		if err := rc.Read(func(fd uintptr) bool {
			size, _, rerr = unix.Recvfrom(int(fd), r.buf, 0)
			return rerr != unix.EAGAIN && rerr != unix.EWOULDBLOCK
		}); err != nil {
			return nil, intr, err
		}
		if rerr != nil {
			return nil, intr, fmt.Errorf("receive: %w", rerr)
		}
		*n += int64(size)
		done, in, err := nl.Messages(r.buf[:size], seq, func(b []byte) error {
			bodies = append(bodies, bytes.Clone(b))
			return nil
		})
		intr = intr || in
		if err != nil || done {
			return bodies, intr, err
		}
	}
}

// ReadFamily reads one family's table (4 or 6) whole, as Read reads each,
// and keeps nothing of it: what reading the second family costs is
// measured beside Read (BenchmarkIPv6Half).
func (r *NetlinkReader) ReadFamily(ctx context.Context, family int) (*audit.Observed, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.conn == nil {
		c, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
		if err != nil {
			return nil, fmt.Errorf("open nf_tables netlink: %w", err)
		}
		r.conn = c
	}
	var n int64
	t, _, err := r.table(ctx, family, &n)
	if err != nil {
		return nil, err
	}
	return FromTables(t)
}
