package collector

import (
	"os/exec"

	"github.com/coreos/go-iptables/iptables"
)

// openIPTables opens go-iptables on one backend's binary; an error that
// is exec.ErrNotFound means the backend is not installed.
func openIPTables(legacy bool) (IPTables, error) {
	name := "iptables"
	if legacy {
		name = "iptables-legacy"
	}
	path, err := exec.LookPath(name)
	if err != nil {
		return nil, err
	}
	return iptables.New(iptables.Path(path))
}
