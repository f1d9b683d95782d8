//go:build !linux

package collector

import "errors"

func openIPVS() (IPVS, error) {
	return nil, errors.New("IPVS can only be read on Linux")
}
