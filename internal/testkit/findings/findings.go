// Package findings holds what tests ask of a list of findings (which node
// has which kind, one node's share) and how they print one, so that every
// suite reads and prints them alike.
package findings

import (
	"fmt"
	"strings"

	"github.com/proxyaudit/proxyaudit/audit"
)

// Has says whether node has a finding of kind.
func Has(fs []audit.TimedFinding, node string, kind audit.Kind) bool {
	for _, f := range fs {
		if f.Node == node && f.Kind == kind {
			return true
		}
	}
	return false
}

// Only is node's findings.
func Only(fs []audit.TimedFinding, node string) []audit.TimedFinding {
	var out []audit.TimedFinding
	for _, f := range fs {
		if f.Node == node {
			out = append(out, f)
		}
	}
	return out
}

// Describe prints one finding a line: node, kind, service, endpoint and
// detail, indented for a test's failure message.
func Describe(fs []audit.TimedFinding) string {
	if len(fs) == 0 {
		return "  (none)"
	}
	var out []string
	for _, f := range fs {
		out = append(out, fmt.Sprintf("  %s %s %s %s (%s)", f.Node, f.Kind, f.Service, f.Endpoint, f.Detail))
	}
	return strings.Join(out, "\n")
}
