package stream

import (
	"errors"
	"fmt"
	"slices"
)

// MissingError says what of a report the state's pool does not hold:
// its top (Report.Top: no node's copy was ever that state), named buckets
// (Report.Buckets) no copy holds, or frontends named by hash (Refs). The
// aggregator asks the collector for the next level down (Want) and applies
// the report once it has it.
type MissingError struct {
	Top     bool
	Buckets []int
	Sums    []string
}

func (e *MissingError) Error() string {
	switch {
	case e.Top:
		return "the state the report names is not known"
	case len(e.Buckets) > 0:
		return fmt.Sprintf("%d named buckets not known", len(e.Buckets))
	}
	return fmt.Sprintf("%d referenced frontends not known", len(e.Sums))
}

// Apply validates a report and applies it to s. It returns whether the
// root matches afterwards; false means the two ends disagree and the
// collector must resync. On a validation error s is unchanged, and a
// *MissingError when the report names a state, buckets or frontends the
// pool does not hold.
func (s *State) Apply(r *Report) (bool, error) {
	if len(r.Frontends)+len(r.Refs) > MaxFrontends || len(r.Removed) > MaxFrontends {
		return false, fmt.Errorf("report claims %d frontends: more than the %d a node can have", len(r.Frontends)+len(r.Refs)+len(r.Removed), MaxFrontends)
	}
	eps := 0
	for _, f := range r.Frontends {
		eps += len(f.Endpoints)
		if _, err := f.ToObserved(); err != nil {
			return false, err
		}
	}
	if eps > MaxEndpoints {
		return false, fmt.Errorf("report claims %d endpoints: more than %d", eps, MaxEndpoints)
	}
	for _, k := range r.Removed {
		if _, err := ParseKey(k); err != nil {
			return false, err
		}
	}
	top, named, err := s.lookup(r)
	if err != nil {
		return false, err
	}
	resolved, err := s.pool.resolve(r.Refs)
	if err != nil {
		return false, err
	}
	next := *s
	if r.Full {
		next = State{pool: s.pool}
	}
	next.Mode, next.NoRules, next.Families = r.Mode, r.NoRules, slices.Clone(r.Families)
	if top != nil {
		next.buckets = *top
		next.n = 0
		for _, b := range top {
			if b != nil {
				next.n += len(b.entries)
			}
		}
	}
	for _, nb := range named {
		if old := next.buckets[nb.i]; old != nil {
			next.n -= len(old.entries)
		}
		if nb.b != nil {
			next.n += len(nb.b.entries)
		}
		next.buckets[nb.i] = nb.b
	}
	if r.Full && next.pool == nil && len(resolved) == 0 {
		next.fill(r.Frontends)
	} else if largest := next.replace(r.Removed, r.Frontends, resolved); largest > maxBucket {
		return false, fmt.Errorf("a bucket of the node's state grew to %d frontends, more than %d: keys chosen to fall together (a change would cost the whole bucket)", largest, maxBucket)
	}
	if next.n > MaxFrontends {
		return false, fmt.Errorf("node state grew to %d frontends: more than %d", next.n, MaxFrontends)
	}
	if r.Buckets != "" {
		if want, _ := parseSum(r.Top); next.top() != want {
			// Short names resolved to other buckets (a collision, or
			// content planted under them): the named buckets not patched
			// yet are asked for frontend by frontend, by full hashes. If
			// that does not add up either, nothing is applied and a full
			// snapshot is asked for.
			var again []int
			for _, nb := range named { // named, not patched
				again = append(again, nb.i)
			}
			if again != nil {
				return false, &MissingError{Buckets: again}
			}
			return false, nil
		}
	}
	*s = next
	if r.Full || top != nil || len(named)+len(r.Frontends)+len(resolved)+len(r.Removed) > 0 {
		// Not for a steady report (most of a fleet's): its state is known.
		s.pool.addTop(s)
	}
	return s.Root() == r.Root, nil
}

// namedBucket is bucket i as a report names it (nil: empty).
type namedBucket struct {
	i int
	b *bucket
}

// lookup resolves what a report names whole: the state its top names
// (every bucket), or the buckets its names name, except those it patches
// with frontends (rebuilt from the copy's bucket instead, or from nothing
// in a full snapshot).
func (s *State) lookup(r *Report) (*[nBuckets]*bucket, []namedBucket, error) {
	if r.Top == "" && r.Buckets == "" && len(r.Patched) == 0 {
		return nil, nil, nil
	}
	if r.Buckets != "" {
		if _, ok := parseSum(r.Top); !ok {
			return nil, nil, fmt.Errorf("bucket names without the state's top (%q)", clip(r.Top))
		}
	}
	if s.pool == nil {
		return nil, nil, errors.New("report names buckets on a stream that holds none")
	}
	if r.Buckets == "" {
		if len(r.Patched) > 0 {
			return nil, nil, errors.New("report patches buckets it does not name")
		}
		if len(r.Frontends)+len(r.Refs)+len(r.Removed) > 0 {
			return nil, nil, errors.New("a report naming its state carries no frontends")
		}
		t, ok := parseSum(r.Top)
		if !ok {
			return nil, nil, fmt.Errorf("malformed state hash %q", clip(r.Top))
		}
		bs := s.pool.top(t)
		if bs == nil {
			return nil, nil, &MissingError{Top: true}
		}
		return bs, nil, nil
	}
	names, err := decodeBuckets(r.Buckets)
	if err != nil {
		return nil, nil, err
	}
	patched := map[int]bool{}
	for _, i := range r.Patched {
		if _, ok := names[i]; !ok {
			return nil, nil, fmt.Errorf("report patches bucket %d it does not name", i)
		}
		patched[i] = true
	}
	outside := func(k string) error {
		if !patched[bucketOf(k)] {
			return fmt.Errorf("frontend %s is outside the buckets the report patches", clip(k))
		}
		return nil
	}
	for _, f := range r.Frontends {
		if err := outside(f.Key); err != nil {
			return nil, nil, err
		}
	}
	for _, f := range r.Refs {
		if err := outside(f.Key); err != nil {
			return nil, nil, err
		}
	}
	for _, k := range r.Removed {
		if err := outside(k); err != nil {
			return nil, nil, err
		}
	}
	var out []namedBucket
	var missing []int
	for i := range nBuckets {
		name, ok := names[i]
		if !ok || patched[i] {
			continue
		}
		if name == ([shortLen]byte{}) {
			out = append(out, namedBucket{i: i})
			continue
		}
		b := s.pool.named(name, i)
		if b == nil {
			missing = append(missing, i)
			continue
		}
		out = append(out, namedBucket{i: i, b: b})
	}
	if missing != nil {
		return nil, nil, &MissingError{Buckets: missing}
	}
	return nil, out, nil
}
