package collector

import (
	"errors"
	"os/exec"

	"github.com/coreos/go-iptables/iptables"
)

// openIPTables opens go-iptables on one backend's binary, for IPv6 with
// v6; on a host without the binary, chain checks ask the kernel itself
// (the readers do not need the binaries either).
func openIPTables(legacy, v6 bool) (IPTables, error) {
	name, proto := "iptables", iptables.ProtocolIPv4
	if v6 {
		name, proto = "ip6tables", iptables.ProtocolIPv6
	}
	if legacy {
		name += "-legacy"
	}
	path, err := exec.LookPath(name)
	if errors.Is(err, exec.ErrNotFound) {
		return kernelIPTables(legacy, v6), nil
	}
	if err != nil {
		return nil, err
	}
	return iptables.New(iptables.Path(path), iptables.IPFamily(proto))
}
