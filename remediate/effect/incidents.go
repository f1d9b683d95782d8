package effect

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/proxyaudit/proxyaudit/remediate"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/clock"
)

// Incidents keeps every node's incident in one ConfigMap in proxyaudit's
// own namespace, one key per node. Not on the Node: a node's kubelet may
// write its own Node's annotations, so a compromised node could hold the
// fleet's budget (a "restarted" incident dated 2099) or have proxyaudit
// undo an admin's cordon. One object makes every decision atomic: a write
// is a compare-and-swap on its resourceVersion, so the budget check and
// the record are one step even while two replicas both believe they lead;
// and each write carries the writer's leadership term, so a replica that
// lost the Lease is fenced out as soon as the new leader has written.
type Incidents struct {
	Client          kubernetes.Interface
	Namespace, Name string
	// MaxAge: Load reads the record again only when the copy in hand is
	// older (0: every Load reads). The leader plans every second; only it
	// writes, and every write is a compare-and-swap that re-reads on a
	// conflict, so a copy up to MaxAge old decides nothing wrongly: it
	// only shows a hand edit that much later.
	MaxAge time.Duration
	// Clock dates the copy for MaxAge (nil: the real clock).
	Clock clock.PassiveClock

	mu       sync.Mutex
	cm       *corev1.ConfigMap // last read or written; nil before the first Load
	copiedAt time.Time         // when cm was read or written
	// exists: the API server has the ConfigMap (update, not create).
	exists bool
}

// TermAnnotation on the record holds the highest leadership term that
// wrote it.
const TermAnnotation = "proxyaudit.io/leader-term"

// Unfenced is the term of a replica that leads without an election
// (--leader-elect=false, one replica): its writes are not fenced and leave
// the recorded term as it is. Without it, a fleet scaled from two
// replicas to one would find every write refused by the last elected
// leader's term.
const Unfenced int64 = -2

// ErrFenced refuses a write from a replica whose leadership term is older
// than the record's: another replica has led since.
var ErrFenced = errors.New("fenced: another replica has led since this one's term began")

// maxRecordBytes keeps the record under the 1 MiB a ConfigMap may hold
// (~6,000 incidents at once; a storm opens none).
const maxRecordBytes = 900 << 10

// Load reads the record unless the copy in hand is younger than MaxAge;
// a missing one is empty (the first write creates it). On error the last
// copy stays.
func (s *Incidents) Load(ctx context.Context) error {
	s.mu.Lock()
	fresh := s.cm != nil && s.MaxAge > 0 && s.now().Sub(s.copiedAt) < s.MaxAge
	s.mu.Unlock()
	if fresh {
		return nil
	}
	return s.read(ctx)
}

func (s *Incidents) now() time.Time {
	if s.Clock == nil {
		return time.Now()
	}
	return s.Clock.Now()
}

// read reads the record from the API server.
func (s *Incidents) read(ctx context.Context) error {
	at := s.now()
	cm, err := s.Client.CoreV1().ConfigMaps(s.Namespace).Get(ctx, s.Name, metav1.GetOptions{})
	exists := err == nil
	if apierrors.IsNotFound(err) {
		cm, err = &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: s.Namespace, Name: s.Name,
			Labels: map[string]string{"app.kubernetes.io/part-of": "proxyaudit", "app.kubernetes.io/component": "incidents"}}}, nil
	}
	if err != nil {
		return fmt.Errorf("read the incident record (ConfigMap %s/%s): %w", s.Namespace, s.Name, err)
	}
	s.mu.Lock()
	s.cm, s.exists, s.copiedAt = cm, exists, at
	s.mu.Unlock()
	return nil
}

// Get is the node's incident in the last copy read or written.
func (s *Incidents) Get(node string, now time.Time) remediate.Incident {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := "", false
	if s.cm != nil {
		v, ok = s.cm.Data[node]
	}
	if !ok {
		return remediate.Incident{}
	}
	// An undecodable entry reads as no incident: a hand edit must not
	// stop remediation.
	inc, _ := remediate.DecodeIncident(v, now)
	return inc
}

// Nodes names the nodes the record holds.
func (s *Incidents) Nodes() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cm == nil {
		return nil
	}
	out := make([]string, 0, len(s.cm.Data))
	for n := range s.cm.Data {
		out = append(out, n)
	}
	return out
}

// Update changes the record in one compare-and-swap: change sees every
// node's incident as stored now (undecodable entries left out) and returns
// the ones to set (an empty incident removes the node); an error from it
// is returned as is, nothing written. On a conflict the record is read
// again and change asked again, so a budget it checks holds against every
// other writer.
func (s *Incidents) Update(ctx context.Context, term int64, now time.Time, change func(all map[string]remediate.Incident) (map[string]remediate.Incident, error)) error {
	for attempt := 0; ; attempt++ {
		s.mu.Lock()
		cm, exists := s.cm.DeepCopy(), s.exists
		s.mu.Unlock()
		if cm == nil {
			if err := s.read(ctx); err != nil {
				return err
			}
			continue
		}
		if t := termOf(cm); term != Unfenced && t > term {
			return fmt.Errorf("%w (record written in term %d, this replica leads term %d)", ErrFenced, t, term)
		}
		all := make(map[string]remediate.Incident, len(cm.Data))
		for n, v := range cm.Data {
			if inc, err := remediate.DecodeIncident(v, now); err == nil {
				all[n] = inc
			}
		}
		set, err := change(all)
		if err != nil || len(set) == 0 {
			return err
		}
		if cm.Data == nil {
			cm.Data = map[string]string{}
		}
		for n, inc := range set {
			if inc.Empty() {
				delete(cm.Data, n)
			} else {
				cm.Data[n] = inc.Encode()
			}
		}
		if size := recordSize(cm); size > maxRecordBytes {
			return fmt.Errorf("the incident record would hold %d bytes, more than a ConfigMap may: too many nodes in remediation at once (%d)", size, len(cm.Data))
		}
		if cm.Annotations == nil {
			cm.Annotations = map[string]string{}
		}
		if term != Unfenced {
			cm.Annotations[TermAnnotation] = strconv.FormatInt(term, 10)
		}
		var out *corev1.ConfigMap
		if !exists {
			out, err = s.Client.CoreV1().ConfigMaps(s.Namespace).Create(ctx, cm, metav1.CreateOptions{})
		} else {
			out, err = s.Client.CoreV1().ConfigMaps(s.Namespace).Update(ctx, cm, metav1.UpdateOptions{})
		}
		if err == nil {
			s.mu.Lock()
			s.cm, s.exists, s.copiedAt = out, true, s.now()
			s.mu.Unlock()
			return nil
		}
		if (apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err)) && attempt < 5 {
			if err := s.read(ctx); err != nil {
				return err
			}
			continue
		}
		return fmt.Errorf("write the incident record (ConfigMap %s/%s): %w", s.Namespace, s.Name, err)
	}
}

func termOf(cm *corev1.ConfigMap) int64 {
	t, _ := strconv.ParseInt(cm.Annotations[TermAnnotation], 10, 64)
	return t
}

func recordSize(cm *corev1.ConfigMap) int {
	n := 0
	for k, v := range cm.Data {
		n += len(k) + len(v)
	}
	return n
}
