//go:build !linux

package collector

func openSignal(Source, int) (ChangeSignal, error) { return nil, nil }
