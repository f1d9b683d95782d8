package cilium

import (
	"encoding/json"
	"fmt"
	"io"

	"github.com/proxyaudit/proxyaudit/audit"
)

// maxDump bounds a Cilium maps dump read whole: 10k services with
// their slots and backends are ~40 MB of hex.
const maxDump = 256 << 20

// ParseMaps reads Cilium's LB maps as a JSON list of MapDump
// (what the collector's reader and deploy/cilium/dump write) and reduces
// them to the audit's model.
func ParseMaps(r io.Reader) (*audit.Observed, error) {
	data, err := io.ReadAll(io.LimitReader(r, maxDump+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxDump {
		return nil, fmt.Errorf("cilium maps input is larger than %d MiB: not a node's LB maps", maxDump>>20)
	}
	var dumps []MapDump
	if err := json.Unmarshal(data, &dumps); err != nil {
		return nil, fmt.Errorf("cilium maps input (a JSON list of maps, as deploy/cilium/dump writes): %w", err)
	}
	lb, err := Decode(dumps)
	if err != nil {
		return nil, err
	}
	if len(lb.Families) == 0 {
		return nil, fmt.Errorf("cilium maps input has no services map (%s or %s): is it a dump of Cilium's LB maps?", Services4, Services6)
	}
	return lb.Observed(), nil
}
