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
