//go:build !linux

package conntrack

import (
	"context"
	"errors"

	"github.com/proxyaudit/proxyaudit/audit"
)

// Reader reads conntrack over netlink: Linux only.
type Reader struct {
	MaxPairs int
}

// Read fails: conntrack is Linux's.
func (r *Reader) Read(context.Context, []audit.FrontendKey) (*audit.Conntrack, error) {
	return nil, errors.New("conntrack: only on Linux")
}

// Delete fails: conntrack is Linux's.
func (r *Reader) Delete(context.Context, []FlushTarget) ([]int, error) {
	return nil, errors.New("conntrack: only on Linux")
}
