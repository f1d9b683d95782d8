package aggregator

import (
	"sync"
	"time"

	"github.com/proxyaudit/proxyaudit/remediate"
	"github.com/proxyaudit/proxyaudit/remediate/effect"
)

// Remediation wires the planner and the executor into the aggregator.
type Remediation struct {
	Policy   remediate.Policy
	Executor *effect.Executor
	// ExemptLabel: nodes carrying this label key are never touched.
	ExemptLabel string
	// Pause reads the fleet-wide pause request; nil: none.
	Pause *effect.Pause
	// Alertmanager keeps incidents alerts there and says which are
	// silenced; nil: none.
	Alertmanager *effect.Alertmanager
}

// remediationState is what the remediation rounds decided for the fleet:
// since when most nodes drift at once (MassDivergence, paged once for the
// fleet; zero: no storm) and why every repair is held (a pause, outside
// the windows; "" when none is), shown by the API.
type remediationState struct {
	mu         sync.Mutex
	stormSince time.Time
	hold       string
}
