//go:build !linux

package ipvs

import "errors"

func Open() (Table, error) {
	return nil, errors.New("IPVS can only be read on Linux")
}
