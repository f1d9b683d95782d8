//go:build !linux

package collector

func openSignal(Source) (ChangeSignal, error) { return nil, nil }
