//go:build !linux

package nftables

import (
	"context"
	"errors"

	"github.com/proxyaudit/proxyaudit/audit"
)

// NetlinkReader reads kube-proxy's nftables tables over netlink: on Linux
// only.
type NetlinkReader struct{}

// NewNetlinkReader returns a reader that says it needs Linux.
func NewNetlinkReader() *NetlinkReader { return &NetlinkReader{} }

func (*NetlinkReader) Read(context.Context) (*audit.Observed, error) {
	return nil, errors.New("nftables over netlink can only be read on Linux")
}

func (*NetlinkReader) String() string { return "nftables (netlink)" }

// Mode is the mode whose rules the reader reads.
func (*NetlinkReader) Mode() audit.Mode { return audit.ModeNFTables }
