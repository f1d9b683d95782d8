//go:build !linux

package collector

import (
	"errors"

	"github.com/proxyaudit/proxyaudit/audit"
)

func readIPVS() (*audit.Observed, error) {
	return nil, errors.New("IPVS can only be read on Linux")
}
