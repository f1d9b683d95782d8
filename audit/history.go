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
	// ownerLost is the touchSeq of the last Update after which a frontend
	// of the owner map was in no kept version any more.
	ownerLost uint64
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
	old := h.owner
	h.owner = make(map[FrontendKey]string, len(old))
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
	for k := range old {
		if _, ok := h.owner[k]; !ok {
			h.ownerLost = h.touchSeq
			break
		}
	}
}

// OwnersLostSince says whether a frontend some kept version had at touch
// seq (see TouchSeq) is now in none: only then can a frontend a node
// showed then, unchanged, have become unowned.
func (h *History) OwnersLostSince(seq uint64) bool { return h.ownerLost > seq }

// Change is one new version of a service in the change log.
type Change struct {
	Seq     uint64
	Service string
	At      time.Time
}

// Passed records a version of one service that the cluster held from at:
// a caller that folds several changes into one Update (a debounced
// rebuild) passes each version first, dated by when it appeared, because a
// kube-proxy may have programmed any of them and its lag runs from the
// next one's time, not from the Update's. A version equal to the newest
// kept one is ignored. Update must follow.
func (h *History) Passed(svc *Service, at time.Time) {
	key := svc.Namespace + "/" + svc.Name
	vs := h.svcs[key]
	if n := len(vs); n > 0 && vs[n-1].Svc != nil && reflect.DeepEqual(vs[n-1].Svc, svc) {
		return
	}
	h.push(key, svc, at)
}

// Gone records that the service namespace/name stopped existing at at,
// for a caller that dates each change by its own event (see Passed); a
// service already gone is ignored. Update must follow.
func (h *History) Gone(key string, at time.Time) {
	vs := h.svcs[key]
	if n := len(vs); n == 0 || vs[n-1].Svc == nil {
		return
	}
	h.svcs[key] = h.prune(append(vs, Version{Since: at}), at)
	h.record(key, at)
	h.touch(key, at)
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
			for _, ip := range s.ClusterIPs { // one node port per family
				out = append(out, NodePortKey(Family(ip), proto, uint16(p.NodePort)))
			}
		}
	}
	return out
}
