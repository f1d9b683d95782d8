//go:build !linux

package cilium

import (
	"errors"
)

// Read needs Linux's BPF maps.
func Read(string) ([]MapDump, error) {
	return nil, errors.New("cilium's BPF maps can only be read on Linux")
}

// Pin needs Linux's BPF maps.
func Pin(string, []MapDump) error {
	return errors.New("cilium's BPF maps can only be pinned on Linux")
}
