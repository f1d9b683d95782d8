//go:build !linux

package collector

import (
	"context"
	"errors"

	"github.com/proxyaudit/proxyaudit/audit"
)

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

func kernelIPTables(legacy, v6 bool) IPTables { return noKernelChains{} }

func nftChainExists(fam int, table, chain string) (bool, error) {
	return false, errors.New("nf_tables can only be asked on Linux")
}

type noKernelChains struct{}

func (noKernelChains) ChainExists(table, chain string) (bool, error) {
	return false, errors.New("the kernel's chains can only be asked on Linux")
}
