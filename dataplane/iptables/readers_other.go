//go:build !linux

package iptables

import (
	"context"
	"errors"

	"github.com/proxyaudit/proxyaudit/audit"
)

// NFTReader reads iptables-nft's nat tables over netlink: on Linux only.
type NFTReader struct{}

// NewNFTReader returns a reader that says it needs Linux.
func NewNFTReader(func(ctx context.Context, fam int) (*audit.Observed, error)) *NFTReader {
	return &NFTReader{}
}

func (*NFTReader) Read(context.Context) (*audit.Observed, error) {
	return nil, errors.New("iptables-nft over netlink can only be read on Linux")
}

func (*NFTReader) String() string { return "iptables (nf_tables backend, netlink)" }

// Mode is the mode whose rules the reader reads.
func (*NFTReader) Mode() audit.Mode { return audit.ModeIPTables }

// LegacyReader reads the legacy backend's nat tables with getsockopt: on
// Linux only.
type LegacyReader struct{}

// NewLegacyReader returns a reader that says it needs Linux.
func NewLegacyReader(func(ctx context.Context, fam int) (*audit.Observed, error)) *LegacyReader {
	return &LegacyReader{}
}

func (*LegacyReader) Read(context.Context) (*audit.Observed, error) {
	return nil, errors.New("iptables-legacy can only be read from the kernel on Linux")
}

func (*LegacyReader) String() string { return "iptables (legacy backend, getsockopt)" }

// Mode is the mode whose rules the reader reads.
func (*LegacyReader) Mode() audit.Mode { return audit.ModeIPTables }

// Legacy: the reader reads the legacy (x_tables) backend.
func (*LegacyReader) Legacy() bool { return true }

// KernelChains opens chain checks without a binary: on Linux only.
func KernelChains(legacy, v6 bool) ChainChecker { return noKernelChains{} }

// NFTChainExists asks nf_tables whether table has chain: on Linux only.
func NFTChainExists(fam int, table, chain string) (bool, error) {
	return false, errors.New("nf_tables can only be asked on Linux")
}

type noKernelChains struct{}

func (noKernelChains) ChainExists(table, chain string) (bool, error) {
	return false, errors.New("the kernel's chains can only be asked on Linux")
}
