//go:build !linux

package ciliummaps

import (
	"errors"

	"github.com/proxyaudit/proxyaudit/audit"
)

// Read needs Linux's BPF maps.
func Read(string) ([]audit.CiliumMapDump, error) {
	return nil, errors.New("cilium's BPF maps can only be read on Linux")
}

// Pin needs Linux's BPF maps.
func Pin(string, []audit.CiliumMapDump) error {
	return errors.New("cilium's BPF maps can only be pinned on Linux")
}
