package effect

import (
	"context"
	"fmt"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/remediate"
)

// Pause reads the fleet-wide pause request from its ConfigMap (the chart
// makes it empty; `proxyaudit pause` fills it, `proxyaudit resume`
// empties it).
type Pause struct {
	Client          kubernetes.Interface
	Namespace, Name string
	// MaxAge: a copy younger than this is used as it is (the leader plans
	// every second; a pause takes effect within MaxAge).
	MaxAge time.Duration
	Clock  clock.PassiveClock

	mu   sync.Mutex
	at   time.Time
	held string
	err  error
}

// Held says who paused remediation and why ("" when it is not paused),
// as the planner's Fleet.Paused. A request that cannot be read or
// understood holds every repair too, saying so: a pause must not be lost
// to a typo or a missing permission. No ConfigMap at all is no pause.
func (p *Pause) Held(ctx context.Context) string {
	clk := p.Clock
	if clk == nil {
		clk = clock.RealClock{}
	}
	now := clk.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.at.IsZero() && now.Sub(p.at) < p.MaxAge {
		return p.held
	}
	p.at = now
	p.held, p.err = p.read(ctx, now)
	return p.held
}

// Err is the last read's error, for logs.
func (p *Pause) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

func (p *Pause) read(ctx context.Context, now time.Time) (string, error) {
	cm, err := p.Client.CoreV1().ConfigMaps(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return "", nil
	}
	if err != nil {
		return fmt.Sprintf("(the pause request %s/%s cannot be read, so repairs are held: %v)", p.Namespace, p.Name, err), err
	}
	req, ok, err := remediate.DecodePause(cm.Data)
	if err != nil {
		return fmt.Sprintf("(the pause request %s/%s is malformed, so repairs are held: %v; fix it or run proxyaudit resume)", p.Namespace, p.Name, err), err
	}
	if !ok || !req.Active(now) {
		return "", nil
	}
	return req.String(), nil
}
