//go:build !linux

package collector

import (
	"context"
	"errors"

	"github.com/proxyaudit/proxyaudit/audit"
)

type noNetlink struct{}

func newNFTNetlinkReader() RuleReader { return noNetlink{} }

func (noNetlink) Read(context.Context) (*audit.Observed, error) {
	return nil, errors.New("nftables over netlink can only be read on Linux")
}

func (noNetlink) String() string { return "nftables (netlink)" }

func newIPTNFTReader(func(ctx context.Context, fam int) (*audit.Observed, error)) RuleReader {
	return noIPTNetlink{}
}

type noIPTNetlink struct{}

func (noIPTNetlink) Read(context.Context) (*audit.Observed, error) {
	return nil, errors.New("iptables-nft over netlink can only be read on Linux")
}

func (noIPTNetlink) String() string { return "iptables (nf_tables backend, netlink)" }

func newLegacyReader(func(ctx context.Context, fam int) (*audit.Observed, error)) RuleReader {
	return noIPTNetlink{}
}
