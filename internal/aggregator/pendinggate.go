package aggregator

import "sync"

// pendingGate counts connections that have not passed their hello, overall and
// by source address: each costs a goroutine and up to a hello's bytes
// before anyone knows who sent it.
type pendingGate struct {
	mu             sync.Mutex
	max, perSource int
	n              int
	bySource       map[string]int
	// isNode says whether a source is an address of a Node of the
	// cluster, where collectors connect from. Other sources (pods, the
	// world) share at most a quarter of max between them: 64 addresses
	// of idle connections filled every slot and locked every collector
	// out. others counts theirs.
	isNode func(string) bool
	others int
}

// enter admits a connection from source unless a limit is reached; the
// returned func leaves (call it once).
func (g *pendingGate) enter(source string) (func(), bool) {
	fromNode := g.isNode != nil && g.isNode(source)
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.n >= g.max || g.bySource[source] >= g.perSource || (!fromNode && g.others >= max(1, g.max/4)) {
		return nil, false
	}
	g.n++
	g.bySource[source]++
	if !fromNode {
		g.others++
	}
	return sync.OnceFunc(func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		g.n--
		if !fromNode {
			g.others--
		}
		if g.bySource[source]--; g.bySource[source] <= 0 {
			delete(g.bySource, source)
		}
	}), true
}
