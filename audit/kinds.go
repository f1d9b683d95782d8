package audit

import (
	"cmp"
	"slices"
	"strings"
	"time"
)

// Kind classifies a finding.
type Kind string

// Finding kinds.
const (
	// StaleEndpoint: the node routes to an address the cluster no longer
	// lists for that service port and scope.
	StaleEndpoint Kind = "StaleEndpoint"
	// MissingEndpoint: an endpoint the node should route to is absent.
	MissingEndpoint Kind = "MissingEndpoint"
	// StaleService: the node has rules for a frontend no service has.
	StaleService Kind = "StaleService"
	// MissingService: a frontend the node should have is absent.
	MissingService Kind = "MissingService"
	// NoRules: the node has no kube-proxy service rules at all (flushed).
	NoRules Kind = "NoRules"
)

// Finding is one way a node's rules differ from the cluster. The JSON field
// names are a public contract (CLI and aggregator API).
type Finding struct {
	Node     string `json:"node"`
	Service  string `json:"service"`
	Port     string `json:"port"`
	Protocol string `json:"protocol"`
	// Family is the IP family (4, 6) of a service-port finding; 0 for
	// findings about the node as a whole.
	Family   int    `json:"family,omitempty"`
	Scope    Scope  `json:"scope"`
	Kind     Kind   `json:"kind"`
	Endpoint string `json:"endpoint"`
	Detail   string `json:"detail"`
	// Flows counts the conntrack flows of a StaleConntrack finding, and
	// Frontend names what they were sent to (KeyString form: "ip:port/PROTO",
	// "nodeport:PORT/PROTO"), so a repair can name exactly those entries.
	Flows    int    `json:"flows,omitempty"`
	Frontend string `json:"frontend,omitempty"`
}

func (f Finding) key() string {
	return strings.Join([]string{f.Node, f.Service, f.Port, f.Protocol, string(rune('0' + f.Family)), string(f.Scope), string(f.Kind), f.Endpoint, f.Frontend}, "\x00")
}

// onNode is key without the node: a finding's identity within one node's
// record. Assessments are shared among the nodes of a class showing the
// same rules and name the node they were made for; the judge names the
// node a finding is about when it reports it.
func (f Finding) onNode() string {
	f.Node = ""
	return f.key()
}

// SortTimed orders timed findings as SortFindings does.
func SortTimed(fs []TimedFinding) {
	slices.SortStableFunc(fs, func(a, b TimedFinding) int { return compareFindings(&a.Finding, &b.Finding) })
}

// SortFindings orders findings by node, service, port, protocol, scope,
// kind and endpoint.
func SortFindings(fs []Finding) {
	slices.SortStableFunc(fs, func(a, b Finding) int { return compareFindings(&a, &b) })
}

// compareFindings orders findings as their keys do, field by field and
// without building the keys (a Service with n ports and n endpoints all
// missing is n² findings: sorting them must not allocate per comparison).
func compareFindings(a, b *Finding) int {
	return cmp.Or(
		strings.Compare(a.Node, b.Node),
		strings.Compare(a.Service, b.Service),
		strings.Compare(a.Port, b.Port),
		strings.Compare(a.Protocol, b.Protocol),
		cmp.Compare(a.Family, b.Family),
		strings.Compare(string(a.Scope), string(b.Scope)),
		strings.Compare(string(a.Kind), string(b.Kind)),
		strings.Compare(a.Endpoint, b.Endpoint),
		strings.Compare(a.Frontend, b.Frontend),
	)
}

// sameFinding is equal keys: the same finding, whatever its detail says.
func sameFinding(a, b Finding) bool { return compareFindings(&a, &b) == 0 }

// Node- and fleet-level finding kinds, raised by a Judge over time.
const (
	// StuckProxy: the node's rules fell behind cluster changes for longer
	// than the grace period. One finding per node, naming its services.
	StuckProxy Kind = "StuckProxy"
	// CollectorMissing: no report from the node's collector for three of
	// its intervals (or it reports only read errors). Absence is not
	// staleness: nothing else is said about the node meanwhile.
	CollectorMissing Kind = "CollectorMissing"
	// MassDivergence: more than the configured share of nodes drifted at
	// once; the aggregator's view or the control-plane path is the more
	// likely culprit, so the node findings are folded into this one.
	MassDivergence Kind = "MassDivergence"
)

// TimedFinding is a finding with the time its condition began and, from
// the aggregator, the time it first reported it.
type TimedFinding struct {
	Finding
	Since time.Time `json:"since"`
	// Found is when the leading aggregator first published the finding
	// (its detection: Found - Since is grace plus how long it took). Zero
	// offline (proxyaudit diff); a new leader finds anew.
	Found time.Time `json:"found,omitzero"`
}
