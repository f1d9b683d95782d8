// Package collectortest has fakes of the collector's kernel interfaces,
// for tests that run without root.
package collectortest

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/ipvs"
	"github.com/proxyaudit/proxyaudit/internal/collector"
)

var (
	_ collector.IPTables   = (*IPTables)(nil)
	_ ipvs.Table           = (*IPVS)(nil)
	_ collector.RuleReader = (*Reader)(nil)

	_ collector.NoEndpointReader = (*Reader)(nil)
)

// IPTables answers chain checks from a set of "table/chain" names.
type IPTables struct {
	Chains map[string]bool
	Err    error
}

// ChainExists implements collector.IPTables.
func (f *IPTables) ChainExists(table, chain string) (bool, error) {
	return f.Chains[table+"/"+chain], f.Err
}

// IPVS serves a fixed table.
type IPVS struct {
	mu      sync.Mutex
	Servers []ipvs.VirtualServer
	Err     error
	Closed  int
}

// VirtualServers implements ipvs.Table.
func (f *IPVS) VirtualServers(context.Context) ([]ipvs.VirtualServer, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.Servers, f.Err
}

// Close implements ipvs.Table.
func (f *IPVS) Close() {
	f.mu.Lock()
	f.Closed++
	f.mu.Unlock()
}

// Reader is a RuleReader whose rules come from a function; it counts
// reads.
type Reader struct {
	Rules func() (*audit.Observed, error)
	// Rejected, when set, are the frontends the rules reject for having
	// no endpoints (collector.NoEndpointReader).
	Rejected func() []audit.FrontendKey
	reads    atomic.Int64
}

// NoEndpoints implements collector.NoEndpointReader.
func (r *Reader) NoEndpoints() []audit.FrontendKey {
	if r.Rejected == nil {
		return nil
	}
	return r.Rejected()
}

// Read implements collector.RuleReader.
func (r *Reader) Read(context.Context) (*audit.Observed, error) {
	r.reads.Add(1)
	return r.Rules()
}

// Reads is how many times Read was called.
func (r *Reader) Reads() int64 { return r.reads.Load() }

func (r *Reader) String() string { return "fake" }
