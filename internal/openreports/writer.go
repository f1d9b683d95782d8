package openreports

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"golang.org/x/time/rate"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/audit"
)

// Resource is the API resource of ClusterReports.
var Resource = schema.GroupVersionResource{Group: "openreports.io", Version: "v1alpha1", Resource: "clusterreports"}

// WriterConfig is how the leader keeps its reports in the API.
type WriterConfig struct {
	Client dynamic.Interface
	// Owner, when set, is written on every report: the garbage collector
	// deletes the reports with it (the chart's ClusterRole, so that `helm
	// uninstall` takes them).
	Owner *OwnerReference
	// WritesPerSecond bounds the API writes (creates, updates, deletes)
	// fleet-wide; Burst how many may go at once. Default 20 and 20.
	WritesPerSecond float64
	Burst           int
	// UpdateEvery: a report whose content changes is rewritten at most
	// this often (default 60 s); one appears and goes at once (within the
	// write rate). Under churn a stuck node's findings change every
	// second; its report follows them once a minute.
	UpdateEvery time.Duration
	// Relist: what the API holds is read again this often (default 10
	// min), so a report deleted or edited by hand is put right.
	Relist time.Duration
	Clock  clock.PassiveClock
	Log    *zap.Logger
	// Writes counts the API writes by verb and outcome; nil: not counted.
	Writes *prometheus.CounterVec
	// QuietNoCRD: an API without the CRD is said once at info (the
	// output is on when the CRD is there), not as a warning.
	QuietNoCRD bool
}

// Writer keeps the API's ClusterReports equal to the newest verdict,
// while this replica leads: the aggregator offers every verdict, the
// writer takes the newest (one it did not get to is replaced, never
// queued) and writes what changed. Only the leader offers; each
// leadership begins by listing the reports that exist (a former
// leader's), so nothing is written twice and nothing is left behind.
type Writer struct {
	cfg   WriterConfig
	limit *rate.Limiter

	mu   sync.Mutex
	next *offer
	wake chan struct{}

	// The writing goroutine's own.
	lead    context.Context // the leadership have was listed in
	listed  time.Time
	have    map[string]ClusterReport
	written map[string]time.Time // when each report was last written
}

type offer struct {
	lead context.Context
	v    *audit.Verdict
}

// NewWriter returns a writer; Run writes.
func NewWriter(cfg WriterConfig) *Writer {
	if cfg.WritesPerSecond <= 0 {
		cfg.WritesPerSecond = 20
	}
	if cfg.Burst <= 0 {
		cfg.Burst = 20
	}
	if cfg.UpdateEvery <= 0 {
		cfg.UpdateEvery = time.Minute
	}
	if cfg.Relist <= 0 {
		cfg.Relist = 10 * time.Minute
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.Log == nil {
		cfg.Log = zap.NewNop()
	}
	return &Writer{cfg: cfg, limit: rate.NewLimiter(rate.Limit(cfg.WritesPerSecond), cfg.Burst), wake: make(chan struct{}, 1)}
}

// Offer hands the writer a verdict of the leadership lead (a context
// that ends with it). It never blocks.
func (w *Writer) Offer(lead context.Context, v *audit.Verdict) {
	w.mu.Lock()
	w.next = &offer{lead: lead, v: v}
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// newer says whether a verdict newer than the one being written waits.
func (w *Writer) newer() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.next != nil
}

// Run writes until ctx ends. After a failed pass it waits (5 s, doubling
// to 1 min) before the next; a missing CRD is said once.
func (w *Writer) Run(ctx context.Context) {
	var backoff time.Duration
	var said string
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.wake:
		}
		w.mu.Lock()
		o := w.next
		w.next = nil
		w.mu.Unlock()
		if o == nil || o.lead.Err() != nil {
			continue
		}
		err := w.sync(o.lead, o.v)
		switch {
		case err == nil:
			backoff, said = 0, ""
			continue
		case o.lead.Err() != nil:
			continue // the leadership ended mid-pass: the next leader lists
		}
		backoff = min(max(2*backoff, 5*time.Second), time.Minute)
		noCRD := errors.Is(err, ErrNoCRD)
		if noCRD {
			backoff = time.Minute
		}
		if msg := err.Error(); msg != said {
			said = msg
			if noCRD && w.cfg.QuietNoCRD {
				w.cfg.Log.Info("no OpenReports written: the API server does not serve openreports.io/v1alpha1 ClusterReports (checked again every minute)")
			} else {
				w.cfg.Log.Warn("cannot write the OpenReports ClusterReports: the findings are still in the report, metrics and Events; retrying", zap.Duration("retry_in", backoff), zap.Error(err))
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		select { // try again with the newest verdict, or this one
		case w.wake <- struct{}{}:
		default:
		}
		w.mu.Lock()
		if w.next == nil {
			w.next = o
		}
		w.mu.Unlock()
	}
}

// ErrNoCRD is returned when the API does not serve ClusterReports.
var ErrNoCRD = errors.New("the API server does not serve openreports.io/v1alpha1 ClusterReports: install the OpenReports CRD (chart value openReports.installCRD=true, or Kyverno/Policy Reporter's), or turn the output off (openReports.enabled=false)")

// sync brings the API to the verdict: deletions first (drift that
// ended), then creations, then updates due. It stops early, without
// error, when a newer verdict waits.
func (w *Writer) sync(lead context.Context, v *audit.Verdict) error {
	if w.lead != lead || w.have == nil || w.cfg.Clock.Since(w.listed) >= w.cfg.Relist {
		have, err := w.list(lead)
		if err != nil {
			return err
		}
		if w.lead != lead {
			w.written = map[string]time.Time{}
		}
		w.lead, w.have, w.listed = lead, have, w.cfg.Clock.Now()
	}
	want := Want(v, slices.Collect(maps.Values(w.have)))
	if w.cfg.Owner != nil {
		for i := range want {
			want[i].Metadata.OwnerReferences = []OwnerReference{*w.cfg.Owner}
		}
	}
	create, update, del := Plan(slices.Collect(maps.Values(w.have)), want)
	res := w.cfg.Client.Resource(Resource)
	for _, name := range del {
		if w.newer() {
			return nil
		}
		if err := w.wait(lead); err != nil {
			return err
		}
		err := res.Delete(lead, name, metav1.DeleteOptions{})
		w.count("delete", err)
		if err != nil && !apierrors.IsNotFound(err) {
			if w.refused(lead, err) {
				w.cfg.Log.Warn("cannot delete a ClusterReport; the others are written", zap.String("report", name), zap.Error(err))
				continue
			}
			return fmt.Errorf("delete ClusterReport %s: %w", name, err)
		}
		delete(w.have, name)
		delete(w.written, name)
	}
	for _, r := range create {
		if w.newer() {
			return nil
		}
		if err := w.put(lead, res, r, false); err != nil {
			if w.refused(lead, err) {
				// One report the API server will not take (a name or label
				// it refuses) must not hold every other node's back.
				w.cfg.Log.Warn("the API server refused a ClusterReport; the others are written", zap.String("report", r.Metadata.Name), zap.Error(err))
				continue
			}
			return err
		}
	}
	now := w.cfg.Clock.Now()
	for _, r := range update {
		if now.Sub(w.written[r.Metadata.Name]) < w.cfg.UpdateEvery {
			continue
		}
		if w.newer() {
			return nil
		}
		if err := w.put(lead, res, r, true); err != nil {
			if w.refused(lead, err) {
				w.cfg.Log.Warn("the API server refused a ClusterReport's update; the others are written", zap.String("report", r.Metadata.Name), zap.Error(err))
				continue
			}
			return err
		}
	}
	return nil
}

// refused says whether err refuses one report only (an invalid object,
// a webhook's no), so that the pass goes on with the rest; a missing CRD,
// an unreachable API server or the leadership ending stop it.
func (w *Writer) refused(lead context.Context, err error) bool {
	if errors.Is(err, ErrNoCRD) || lead.Err() != nil {
		return false
	}
	return apierrors.IsInvalid(err) || apierrors.IsBadRequest(err) || apierrors.IsRequestEntityTooLargeError(err)
}

// put creates or updates one report and records what the API holds.
// An update that lost a race, or a create that found the report, reads
// it again: the next pass writes over what is there.
func (w *Writer) put(lead context.Context, res dynamic.NamespaceableResourceInterface, r ClusterReport, update bool) error {
	u, err := toUnstructured(r)
	if err != nil {
		return err
	}
	if err := w.wait(lead); err != nil {
		return err
	}
	var got *unstructured.Unstructured
	verb := "create"
	if update {
		verb = "update"
		got, err = res.Update(lead, u, metav1.UpdateOptions{})
	} else {
		got, err = res.Create(lead, u, metav1.CreateOptions{})
	}
	w.count(verb, err)
	name := r.Metadata.Name
	switch {
	case err == nil:
		w.written[name] = w.cfg.Clock.Now()
	case apierrors.IsNotFound(err) && update:
		delete(w.have, name) // deleted behind our back: created next pass
		return nil
	case apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err):
		got, err = res.Get(lead, name, metav1.GetOptions{})
		if err != nil {
			if apierrors.IsNotFound(err) {
				delete(w.have, name)
				return nil
			}
			return fmt.Errorf("read ClusterReport %s after a conflict: %w", name, err)
		}
	default:
		if apierrors.IsNotFound(err) {
			return ErrNoCRD
		}
		return fmt.Errorf("%s ClusterReport %s (%d results): %w", verb, name, len(r.Results), err)
	}
	h, err := fromUnstructured(got)
	if err != nil {
		return err
	}
	w.have[name] = h
	return nil
}

// list reads the reports proxyaudit wrote, a former leader's included.
func (w *Writer) list(ctx context.Context) (map[string]ClusterReport, error) {
	res := w.cfg.Client.Resource(Resource)
	have := map[string]ClusterReport{}
	opts := metav1.ListOptions{LabelSelector: LabelManagedBy + "=" + Source, Limit: 500}
	for {
		l, err := res.List(ctx, opts)
		if apierrors.IsNotFound(err) {
			return nil, ErrNoCRD
		}
		if err != nil {
			return nil, fmt.Errorf("list ClusterReports: %w", err)
		}
		for i := range l.Items {
			r, err := fromUnstructured(&l.Items[i])
			if err != nil {
				return nil, err
			}
			have[r.Metadata.Name] = r
		}
		if opts.Continue = l.GetContinue(); opts.Continue == "" {
			return have, nil
		}
	}
}

func (w *Writer) wait(ctx context.Context) error {
	return w.limit.Wait(ctx)
}

func (w *Writer) count(verb string, err error) {
	if w.cfg.Writes == nil {
		return
	}
	outcome := "ok"
	if err != nil {
		outcome = "error"
	}
	w.cfg.Writes.WithLabelValues(verb, outcome).Inc()
}

func toUnstructured(r ClusterReport) (*unstructured.Unstructured, error) {
	raw, err := json.Marshal(r)
	if err != nil {
		return nil, err
	}
	u := &unstructured.Unstructured{}
	return u, u.UnmarshalJSON(raw)
}

func fromUnstructured(u *unstructured.Unstructured) (ClusterReport, error) {
	var r ClusterReport
	raw, err := u.MarshalJSON()
	if err != nil {
		return r, err
	}
	if err := json.Unmarshal(raw, &r); err != nil {
		return r, fmt.Errorf("ClusterReport %s: %w", u.GetName(), err)
	}
	return r, nil
}
