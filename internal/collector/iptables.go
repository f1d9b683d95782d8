package collector

import (
	"errors"
	"os/exec"

	goiptables "github.com/coreos/go-iptables/iptables"

	"github.com/proxyaudit/proxyaudit/dataplane/iptables"
)

// openIPTables opens go-iptables on one backend's binary, for IPv6 with
// v6; on a host without the binary, chain checks ask the kernel itself
// (the readers do not need the binaries either).
func openIPTables(legacy, v6 bool) (IPTables, error) {
	name, proto := "iptables", goiptables.ProtocolIPv4
	if v6 {
		name, proto = "ip6tables", goiptables.ProtocolIPv6
	}
	if legacy {
		name += "-legacy"
	}
	path, err := exec.LookPath(name)
	if errors.Is(err, exec.ErrNotFound) {
		return iptables.KernelChains(legacy, v6), nil
	}
	if err != nil {
		return nil, err
	}
	return goiptables.New(goiptables.Path(path), goiptables.IPFamily(proto))
}
