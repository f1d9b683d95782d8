package audit

import (
	"net/netip"
	"reflect"
	"sort"
	"time"
)

// Version is one state of a service as the cluster published it, from
// Since until the next version. Svc is nil while the service does not exist
// (before it was created, after it was deleted).
type Version struct {
	Since time.Time
	Svc   *Service
}

// History keeps the recent versions of every service, so that a node's
// rules can be matched against what the cluster said a little while ago:
// a node showing an older version is lagging (since the next version
// appeared); a node showing no version at all is divergent. Time is passed
// in; History does no I/O.
type History struct {
	// Keep is how long a superseded version stays matchable. It must
	// exceed the grace period, or a lagging node would look divergent.
	Keep time.Duration
	// MaxVersions bounds the versions kept per service.
	MaxVersions int

	svcs map[string][]Version
	// changes is a bounded log of every new version, for measuring how
	// long each node took to show it (programming latency).
	changes []Change
	seq     uint64
	// owner maps every frontend any kept version had to its service,
	// current versions winning; rebuilt by Update.
	owner map[FrontendKey]string
	// touched logs every service whose kept versions changed in any way
	// (a new version, an old one pruned, forgotten), for callers that
	// reassess only what changed; bounded like changes.
	touched  []Change
	touchSeq uint64
}

// NewHistory returns an empty history keeping superseded versions for keep.
func NewHistory(keep time.Duration) *History {
	return &History{Keep: keep, MaxVersions: 64, svcs: map[string][]Version{}}
}

// Update records the cluster state seen at now: every service that
// appeared, changed or disappeared gets a new version.
func (h *History) Update(st *State, now time.Time) {
	present := make(map[string]bool, len(st.Services))
	for i := range st.Services {
		s := &st.Services[i]
		key := s.Namespace + "/" + s.Name
		present[key] = true
		vs := h.svcs[key]
		if n := len(vs); n > 0 && vs[n-1].Svc != nil && reflect.DeepEqual(vs[n-1].Svc, s) {
			if n > 1 {
				pruned := h.prune(vs, now)
				if len(pruned) != n {
					h.touch(key, now)
				}
				h.svcs[key] = pruned
			}
			continue
		}
		h.push(key, s, now)
	}
	for key, vs := range h.svcs {
		if present[key] {
			continue
		}
		n := len(vs)
		if vs[n-1].Svc != nil {
			vs = append(vs, Version{Since: now})
			h.record(key, now)
			h.touch(key, now)
		}
		vs = h.prune(vs, now)
		if len(vs) == 1 && vs[0].Svc == nil && now.Sub(vs[0].Since) > h.Keep {
			delete(h.svcs, key)
			h.touch(key, now)
			continue
		}
		if len(vs) < n {
			h.touch(key, now)
		}
		h.svcs[key] = vs
	}
	h.owner = map[FrontendKey]string{}
	for _, current := range []bool{false, true} {
		for key, vs := range h.svcs {
			for i, v := range vs {
				if v.Svc != nil && (i == len(vs)-1) == current {
					for _, k := range serviceKeys(v.Svc) {
						h.owner[k] = key
					}
				}
			}
		}
	}
}

// Change is one new version of a service in the change log.
type Change struct {
	Seq     uint64
	Service string
	At      time.Time
}

// Passed records a version of one service that the cluster held between
// two States and no State showed: a caller that folds several changes into
// one Update (a debounced rebuild) passes the ones in between first, with
// the same time, because a kube-proxy may have programmed any of them. A
// version equal to the newest kept one is ignored. Update must follow.
func (h *History) Passed(svc *Service, at time.Time) {
	key := svc.Namespace + "/" + svc.Name
	vs := h.svcs[key]
	if n := len(vs); n > 0 && vs[n-1].Svc != nil && reflect.DeepEqual(vs[n-1].Svc, svc) {
		return
	}
	h.push(key, svc, at)
}

// push makes a copy of s key's newest version, seen at at.
func (h *History) push(key string, s *Service, at time.Time) {
	vs := h.svcs[key]
	cp := *s
	if len(vs) == 0 {
		// Before its first version the service did not exist (or existed
		// before the aggregator started: a node still without it is
		// lagging from now, not divergent).
		vs = append(vs, Version{Since: at})
	}
	h.svcs[key] = h.prune(append(vs, Version{Since: at, Svc: &cp}), at)
	h.record(key, at)
	h.touch(key, at)
}

// maxChanges bounds the change log: at 100 endpoint changes per second it
// spans more than ten minutes.
const maxChanges = 1 << 16

func (h *History) record(service string, at time.Time) {
	h.seq++
	if len(h.changes) == maxChanges {
		h.changes = append(h.changes[:0], h.changes[maxChanges/2:]...)
	}
	h.changes = append(h.changes, Change{Seq: h.seq, Service: service, At: at})
}

func (h *History) touch(service string, at time.Time) {
	h.touchSeq++
	if len(h.touched) == maxChanges {
		h.touched = append(h.touched[:0], h.touched[maxChanges/2:]...)
	}
	h.touched = append(h.touched, Change{Seq: h.touchSeq, Service: service, At: at})
}

// TouchSeq is the sequence number of the newest touch (see TouchedSince).
func (h *History) TouchSeq() uint64 { return h.touchSeq }

// TouchedSince returns the services whose kept versions changed in any way
// after seq: a new version, an old one pruned, the service forgotten. ok is
// false when the log no longer reaches back to seq (reassess everything).
func (h *History) TouchedSince(seq uint64) (services []string, ok bool) {
	if seq == h.touchSeq {
		return nil, true
	}
	if len(h.touched) == 0 || h.touched[0].Seq > seq+1 {
		return nil, false
	}
	i := sort.Search(len(h.touched), func(i int) bool { return h.touched[i].Seq > seq })
	seen := map[string]bool{}
	for _, c := range h.touched[i:] {
		if !seen[c.Service] {
			seen[c.Service] = true
			services = append(services, c.Service)
		}
	}
	return services, true
}

// Owner returns the service (namespace/name) whose kept versions have the
// frontend, current versions first; IPVS per-address virtual servers
// belong to the node port they serve.
func (h *History) Owner(k FrontendKey, mode Mode) (string, bool) {
	return ownerOf(h.owner, &ObservedFrontend{FrontendKey: k}, mode)
}

// ServiceKeys lists the frontends any kept version of the service has
// (cluster, external and load-balancer IPs per port, and node ports).
func (h *History) ServiceKeys(service string) []FrontendKey {
	seen := map[FrontendKey]bool{}
	var out []FrontendKey
	for _, v := range h.svcs[service] {
		if v.Svc == nil {
			continue
		}
		for _, k := range serviceKeys(v.Svc) {
			if !seen[k] {
				seen[k] = true
				out = append(out, k)
			}
		}
	}
	return out
}

// AssessService assesses one service on one node, as Assess does for
// each service it finds affected. obs must hold the node's frontends for
// the service's keys (ServiceKeys; in IPVS mode also the per-address
// virtual servers of its node ports), and may hold more. cur is the
// service's current version (nil when deleted). The result is InSync with
// no draining when the node shows the current version.
func AssessService(st *State, h *History, node string, obs *Observed, svc string, cur *Service) ServiceAssessment {
	byKey := make(map[FrontendKey]*ObservedFrontend, len(obs.Frontends))
	for i := range obs.Frontends {
		byKey[obs.Frontends[i].FrontendKey] = &obs.Frontends[i]
	}
	a := assessService(st, h, node, obs, byKey, svc, cur)
	// Only IPVS has weights: elsewhere nothing can be draining.
	if cur != nil && obs.Mode == ModeIPVS {
		one := &State{Nodes: st.Nodes, Services: []Service{*cur}}
		keys := map[FrontendKey]bool{}
		for _, k := range h.ServiceKeys(svc) {
			keys[k] = true
		}
		a.Draining = Draining(ExpectedFor(one, node), restrict(obs, byKey, keys))
	}
	return a
}

// LastSeq is the sequence number of the newest change (0 before any).
func (h *History) LastSeq() uint64 { return h.seq }

// ChangesSince returns the changes after seq that the log still holds,
// oldest first. The slice is shared: do not modify it.
func (h *History) ChangesSince(seq uint64) []Change {
	i := sort.Search(len(h.changes), func(i int) bool { return h.changes[i].Seq > seq })
	return h.changes[i:]
}

// prune drops versions superseded for longer than Keep, and the oldest
// beyond MaxVersions; the current version always stays.
func (h *History) prune(vs []Version, now time.Time) []Version {
	i := 0
	for i < len(vs)-1 && now.Sub(vs[i+1].Since) > h.Keep {
		i++
	}
	if n := len(vs) - i; h.MaxVersions > 0 && n > h.MaxVersions {
		i += n - h.MaxVersions
	}
	return vs[i:]
}

// Versions returns the kept versions of namespace/name, oldest first.
func (h *History) Versions(service string) []Version { return h.svcs[service] }

// ServiceState is how a node's rules for one service compare with the
// cluster.
type ServiceState string

// Service states.
const (
	InSync    ServiceState = "InSync"
	Lagging   ServiceState = "Lagging"
	Divergent ServiceState = "Divergent"
)

// ServiceAssessment says how one service differs on one node.
type ServiceAssessment struct {
	// Service is namespace/name; empty for rules no known service owns.
	Service string
	State   ServiceState
	// Since is when the node fell behind, for Lagging: when the version
	// after the one the node shows appeared. Zero for Divergent: only the
	// caller knows when it first saw the divergence.
	Since time.Time
	// Findings are the differences from the current version.
	Findings []Finding
	// Draining are IPVS real servers at weight 0 that the current version
	// no longer lists: normal while their connections last, a leftover
	// once older than the judge's WeightZeroLimit. A service with only
	// these is InSync.
	Draining []Finding
}

// Assess compares a node's rules with the current cluster state (which
// h.Update must have recorded) and, for
// every service that differs, with the service's recent versions. It
// returns only services that are not in sync or hold draining IPVS real
// servers, sorted by service; a node
// with no rules at all returns nil (the caller reports NoRules).
func Assess(st *State, h *History, node string, obs *Observed) []ServiceAssessment {
	if obs.NoRules {
		return nil
	}
	exp := ExpectedFor(st, node)
	raw := Diff(exp, obs)
	drain := Draining(exp, obs)
	if len(raw) == 0 && len(drain) == 0 {
		return nil
	}
	current := make(map[string]*Service, len(st.Services))
	for i := range st.Services {
		s := &st.Services[i]
		current[s.Namespace+"/"+s.Name] = s
	}
	expected := map[FrontendKey]bool{}
	for _, p := range exp.Ports {
		for _, fe := range p.Frontends {
			expected[fe.FrontendKey] = true
		}
	}
	byKey := make(map[FrontendKey]*ObservedFrontend, len(obs.Frontends))
	affected := map[string]bool{}
	var unowned []ObservedFrontend
	for i := range obs.Frontends {
		of := &obs.Frontends[i]
		byKey[of.FrontendKey] = of
		if expected[of.FrontendKey] {
			continue
		}
		if o, ok := ownerOf(h.owner, of, obs.Mode); ok {
			affected[o] = true
		} else {
			unowned = append(unowned, *of)
		}
	}
	for _, f := range raw {
		if f.Kind != StaleService && f.Service != "" && current[f.Service] != nil {
			affected[f.Service] = true
		}
	}
	draining := map[string][]Finding{}
	for _, f := range drain {
		draining[f.Service] = append(draining[f.Service], f)
		affected[f.Service] = true
	}
	var out []ServiceAssessment
	for svc := range affected {
		a := assessService(st, h, node, obs, byKey, svc, current[svc])
		a.Draining = draining[svc]
		if a.State != InSync || len(a.Draining) > 0 {
			out = append(out, a)
		}
	}
	if len(unowned) > 0 {
		a := ServiceAssessment{State: Divergent}
		for _, of := range unowned {
			f := staleService(of)
			f.Node = node
			a.Findings = append(a.Findings, f)
		}
		SortFindings(a.Findings)
		out = append(out, a)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Service < out[j].Service })
	return out
}

func ownerOf(owner map[FrontendKey]string, of *ObservedFrontend, mode Mode) (string, bool) {
	if o, ok := owner[of.FrontendKey]; ok {
		return o, true
	}
	if mode == ModeIPVS && !of.NodePort {
		// IPVS has a virtual server per node address for a node port.
		o, ok := owner[FrontendKey{NodePort: true, Protocol: of.Protocol, Port: of.Port}]
		return o, ok
	}
	return "", false
}

// assessService matches the node's rules for one service against its
// current and then older versions.
func assessService(st *State, h *History, node string, obs *Observed, byKey map[FrontendKey]*ObservedFrontend, svc string, cur *Service) ServiceAssessment {
	versions := h.Versions(svc)
	// Every frontend any version had: rules for a frontend the version
	// lacks count against that version.
	keys := map[FrontendKey]bool{}
	if cur != nil {
		for _, k := range serviceKeys(cur) {
			keys[k] = true
		}
	}
	for _, v := range versions {
		if v.Svc != nil {
			for _, k := range serviceKeys(v.Svc) {
				keys[k] = true
			}
		}
	}
	mine := restrict(obs, byKey, keys)
	diffAt := func(s *Service) []Finding {
		one := &State{Nodes: st.Nodes}
		if s != nil {
			one.Services = []Service{*s}
		}
		return Diff(ExpectedFor(one, node), mine)
	}
	a := ServiceAssessment{Service: svc, Findings: diffAt(cur)}
	if len(a.Findings) == 0 {
		a.State = InSync
		return a
	}
	// Newest first; the last version is the current one (or absent).
	for i := len(versions) - 2; i >= 0; i-- {
		if len(diffAt(versions[i].Svc)) == 0 {
			a.State, a.Since = Lagging, versions[i+1].Since
			return a
		}
	}
	a.State = Divergent
	return a
}

// restrict returns the part of obs whose frontends are in keys (and, in
// IPVS mode, the per-address virtual servers of those node ports).
func restrict(obs *Observed, byKey map[FrontendKey]*ObservedFrontend, keys map[FrontendKey]bool) *Observed {
	o := &Observed{Mode: obs.Mode, Families: obs.Families, RejectsKnown: obs.RejectsKnown, Rejects: map[FrontendKey]bool{}}
	for k := range keys {
		if of, ok := byKey[k]; ok {
			o.Frontends = append(o.Frontends, *of)
		}
		if obs.Rejects[k] {
			o.Rejects[k] = true
		}
	}
	if obs.Mode == ModeIPVS {
		for _, of := range obs.Frontends {
			if !of.NodePort && !keys[of.FrontendKey] && keys[FrontendKey{NodePort: true, Protocol: of.Protocol, Port: of.Port}] {
				o.Frontends = append(o.Frontends, of)
			}
		}
	}
	o.normalize()
	return o
}

// serviceKeys lists the node-independent frontends of a service: cluster,
// external and load-balancer IPs per port, and node ports.
func serviceKeys(s *Service) []FrontendKey {
	var out []FrontendKey
	for _, p := range s.Ports {
		proto := string(p.Protocol)
		if proto == "" {
			proto = "TCP"
		}
		port := uint16(p.Port)
		for _, ips := range [][]netip.Addr{s.ClusterIPs, s.ExternalIPs, s.LBIPs} {
			for _, ip := range ips {
				out = append(out, FrontendKey{IP: ip, Protocol: proto, Port: port})
			}
		}
		if p.NodePort != 0 {
			out = append(out, FrontendKey{NodePort: true, Protocol: proto, Port: uint16(p.NodePort)})
		}
	}
	return out
}
