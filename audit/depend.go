package audit

import (
	"hash/fnv"
	"slices"
	"sort"
)

// Dependents says, for every service the History keeps, which facts of a
// node its expected rules depend on, over every kept version (a node is
// matched against old versions too): the node's zone, when some version's
// endpoints carry zone hints; the node's name, when some version has
// endpoints on it under a Local traffic policy or names it in node hints.
// Most services depend on neither, and every node expects the same of
// them. Two nodes with the same Key for a service get the same
// ExpectedFor for every version of it, so an assessment of that service
// made for one holds for the other when their rules for it are the same.
//
// It is kept current from the History's touch log (Update): only the
// services touched since are recomputed.
type Dependents struct {
	seq    uint64
	synced bool
	// nodes: by service, the nodes whose name its expectations depend on.
	nodes  map[string][]string
	byNode map[string]map[string]bool // the reverse
	zoned  map[string]bool            // services depending on the zone
}

// Update brings d up to h: the services touched since its last Update
// (every service the first time, or when the log no longer reaches back).
func (d *Dependents) Update(h *History) {
	touched, ok := h.TouchedSince(d.seq)
	if !ok || !d.synced {
		d.nodes, d.byNode, d.zoned = map[string][]string{}, map[string]map[string]bool{}, map[string]bool{}
		touched = make([]string, 0, len(h.svcs))
		for svc := range h.svcs {
			touched = append(touched, svc)
		}
		d.synced = true
	}
	d.seq = h.TouchSeq()
	for _, svc := range touched {
		for _, n := range d.nodes[svc] {
			delete(d.byNode[n], svc)
			if len(d.byNode[n]) == 0 {
				delete(d.byNode, n)
			}
		}
		delete(d.nodes, svc)
		delete(d.zoned, svc)
		zone, nodes := dependence(h.svcs[svc])
		if zone {
			d.zoned[svc] = true
		}
		if len(nodes) > 0 {
			d.nodes[svc] = nodes
			for _, n := range nodes {
				if d.byNode[n] == nil {
					d.byNode[n] = map[string]bool{}
				}
				d.byNode[n][svc] = true
			}
		}
	}
}

// dependence scans a service's kept versions.
func dependence(vs []Version) (zone bool, nodes []string) {
	for _, v := range vs {
		if v.Svc == nil || v.Svc.Skip != "" {
			continue
		}
		local := v.Svc.ITPLocal || v.Svc.ETPLocal
		for _, sl := range v.Svc.Slices {
			for _, e := range sl.Endpoints {
				if len(e.ZoneHints) > 0 {
					zone = true
				}
				if local && e.NodeName != "" {
					nodes = append(nodes, e.NodeName)
				}
				nodes = append(nodes, e.NodeHints...)
			}
		}
	}
	sort.Strings(nodes)
	return zone, slices.Compact(nodes)
}

// Key is what of the node (name, zone) the service's expectations depend
// on: "" for most services.
func (d *Dependents) Key(svc, node, zone string) string {
	k := ""
	if d.zoned[svc] {
		k = "zone=" + zone
	}
	if d.byNode[node][svc] {
		k += "|node=" + node
	}
	return k
}

// Class is a digest of Key over every service: nodes of one class expect
// the same of every service, in every kept version.
func (d *Dependents) Class(node, zone string) uint64 {
	h := fnv.New64a()
	if len(d.zoned) > 0 {
		h.Write([]byte("zone=" + zone))
	}
	svcs := make([]string, 0, len(d.byNode[node]))
	for s := range d.byNode[node] {
		svcs = append(svcs, s)
	}
	sort.Strings(svcs)
	for _, s := range svcs {
		h.Write([]byte{0})
		h.Write([]byte(s))
	}
	return h.Sum64()
}

// Differ calls f with every service whose Key differs between the two
// nodes (by name and zone).
func (d *Dependents) Differ(nodeA, zoneA, nodeB, zoneB string, f func(svc string)) {
	if zoneA != zoneB {
		for s := range d.zoned {
			f(s)
		}
	}
	if nodeA == nodeB {
		return
	}
	for _, n := range []string{nodeA, nodeB} {
		for s := range d.byNode[n] {
			if zoneA == zoneB || !d.zoned[s] {
				f(s)
			}
		}
	}
}
