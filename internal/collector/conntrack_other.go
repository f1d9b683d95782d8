//go:build !linux

package collector

import (
	"context"
	"errors"

	"github.com/proxyaudit/proxyaudit/audit"
)

// ConntrackReader reads conntrack over netlink: Linux only.
type ConntrackReader struct {
	MaxPairs int
}

// Read fails: conntrack is Linux's.
func (r *ConntrackReader) Read(context.Context, []audit.FrontendKey) (*audit.Conntrack, error) {
	return nil, errors.New("conntrack: only on Linux")
}

// Delete fails: conntrack is Linux's.
func (r *ConntrackReader) Delete(context.Context, []FlushTarget) ([]int, error) {
	return nil, errors.New("conntrack: only on Linux")
}
