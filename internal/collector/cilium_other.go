//go:build !linux

package collector

import (
	"errors"

	"github.com/proxyaudit/proxyaudit/audit"
)

// ReadCiliumMaps needs Linux's BPF maps.
func ReadCiliumMaps(string) ([]audit.CiliumMapDump, error) {
	return nil, errors.New("cilium's BPF maps can only be read on Linux")
}
