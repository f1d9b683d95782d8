package aggregator

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// maxQueued bounds the reports held behind a parked one.
const maxQueued = 4

// arrived is a report with the time it began to arrive: what it shows
// is judged as of then, not as of when the aggregator got round to it.
// Dated when applied, a report that waited ten seconds for the content it
// named (a new leader resolving a fleet's snapshots) showed a healthy
// node ten seconds behind: false StuckProxy at 2,000 nodes.
type arrived struct {
	report *stream.Report
	at     time.Time
}

// waiting is a report parked until the collector sends the next level
// down of what it named (bucket names for its top, changed frontends of
// unknown buckets, content of unknown frontends), with the reports that
// arrived meanwhile.
type waiting struct {
	report arrived
	queued []arrived
	want   stream.Want
	asked  map[string]bool
}

// ask records what to want of the collector for what is missing.
func (w *waiting) ask(seq uint64, m *stream.MissingError) {
	w.want = stream.Want{Seq: seq}
	switch {
	case m.Top:
		w.want.Buckets = true
	case len(m.Buckets) > 0:
		w.want.Delta = m.Buckets
	default:
		w.want.Sums = m.Sums
		w.asked = make(map[string]bool, len(m.Sums))
		for _, s := range m.Sums {
			w.asked[s] = true
		}
	}
}

// again reports whether what is missing after the collector's answer is
// what was asked: it no longer has it.
func (w *waiting) again(m *stream.MissingError) bool {
	switch {
	case m.Top:
		return w.want.Buckets
	case len(m.Buckets) > 0:
		return slices.ContainsFunc(m.Buckets, func(i int) bool { return slices.Contains(w.want.Delta, i) })
	}
	return slices.ContainsFunc(m.Sums, func(s string) bool { return w.asked[s] })
}

// fill moves the collector's answer into the parked report. Only what was
// asked may come: bucket names when they were asked; changed frontends of
// the buckets asked (checked where the report is applied); frontends that
// each hash to an asked sum named under their own key.
func (w *waiting) fill(ct *stream.Content) error {
	if ct.Buckets != "" && !w.want.Buckets {
		return errors.New("bucket names were not asked for")
	}
	if (len(ct.Refs) > 0 || len(ct.Removed) > 0) && len(w.want.Delta) == 0 {
		return errors.New("changed frontends were not asked for")
	}
	r := *w.report.report
	switch {
	case w.want.Buckets:
		if len(ct.Frontends) > 0 {
			return errors.New("frontends sent for bucket names")
		}
		r.Buckets = ct.Buckets
	case len(w.want.Delta) > 0:
		if ct.Buckets != "" || len(ct.Frontends) > 0 {
			return errors.New("content besides the changed frontends asked for")
		}
		// An empty answer: the collector no longer has that report; the
		// buckets stay missing and the collector is resynced.
		if len(ct.Refs)+len(ct.Removed) > 0 {
			r.Refs = append(slices.Clone(r.Refs), ct.Refs...)
			r.Removed = append(slices.Clone(r.Removed), ct.Removed...)
			r.Patched = append(slices.Clone(r.Patched), w.want.Delta...)
		}
	default:
		if err := w.fillFrontends(&r, ct.Frontends); err != nil {
			return err
		}
	}
	w.report.report = &r
	return nil
}

// fillFrontends moves the frontends the collector sent from the parked
// report's refs to its content.
func (w *waiting) fillFrontends(r *stream.Report, fs []stream.Frontend) error {
	if len(fs) > len(w.asked) {
		return fmt.Errorf("%d frontends sent for %d asked", len(fs), len(w.asked))
	}
	got := make(map[string]stream.Frontend, len(fs))
	for _, f := range fs {
		sum := f.Sum()
		if !w.asked[sum] {
			return fmt.Errorf("frontend %s was not asked for", clip(f.Key))
		}
		got[sum] = f
	}
	r.Frontends = slices.Clone(r.Frontends)
	r.Refs = nil
	for _, ref := range w.report.report.Refs {
		f, ok := got[ref.Sum]
		switch {
		case !ok:
			r.Refs = append(r.Refs, ref)
		case f.Key != ref.Key:
			return fmt.Errorf("frontend %s sent for a hash named under %s", clip(f.Key), clip(ref.Key))
		default:
			r.Frontends = append(r.Frontends, f)
		}
	}
	return nil
}

// countNamed counts what a report named by hash that the aggregator knew
// or wanted (missing: what it wants next).
func (a *Aggregator) countNamed(r *stream.Report, missing *stream.MissingError) {
	m := a.cfg.Metrics
	switch {
	case missing == nil:
		if r.Top != "" && r.Buckets == "" {
			m.Named.WithLabelValues("top", "known").Inc()
		}
		if len(r.Refs) > 0 {
			m.Refs.WithLabelValues("known").Add(float64(len(r.Refs)))
		}
	case missing.Top:
		m.Named.WithLabelValues("top", "wanted").Inc()
	case len(missing.Buckets) > 0:
		m.Named.WithLabelValues("bucket", "wanted").Add(float64(len(missing.Buckets)))
	default:
		m.Refs.WithLabelValues("wanted").Add(float64(len(missing.Sums)))
	}
}
