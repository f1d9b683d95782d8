package fleetsim

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// Populate creates the synthetic cluster's namespace, Services and
// EndpointSlices, and n Node objects named name(i), with workers requests
// in flight. It returns the created slices, whose endpoints Churn changes.
func Populate(ctx context.Context, client kubernetes.Interface, spec synth.Spec, n int, name func(int) string, workers int) ([]*discoveryv1.EndpointSlice, error) {
	if err := spec.Validate(); err != nil {
		return nil, err
	}
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: synth.Namespace}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return nil, err
	}
	svcs, sl := spec.Objects()
	out := make([]*discoveryv1.EndpointSlice, len(sl))
	jobs := make(chan func() error)
	errc := make(chan error, workers)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				if err := j(); err != nil {
					select {
					case errc <- err:
					default:
					}
				}
			}
		}()
	}
	send := func(j func() error) bool {
		select {
		case jobs <- j:
			return true
		case err := <-errc:
			errc <- err
			return false
		case <-ctx.Done():
			return false
		}
	}
	for i := range n {
		if !send(func() error {
			_, err := client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name(i)}}, metav1.CreateOptions{})
			return err
		}) {
			break
		}
	}
	for i := range svcs {
		if !send(func() error {
			if _, err := client.CoreV1().Services(synth.Namespace).Create(ctx, &svcs[i], metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("create service %s: %w", svcs[i].Name, err)
			}
			return nil
		}) {
			break
		}
	}
	for i := range sl {
		if !send(func() error {
			s, err := client.DiscoveryV1().EndpointSlices(synth.Namespace).Create(ctx, &sl[i], metav1.CreateOptions{})
			out[i] = s
			if err != nil {
				return fmt.Errorf("create endpointslice %s: %w", sl[i].Name, err)
			}
			return nil
		}) {
			break
		}
	}
	close(jobs)
	wg.Wait()
	select {
	case err := <-errc:
		return nil, err
	default:
	}
	return out, ctx.Err()
}

// Churn replaces one endpoint of a random EndpointSlice perSecond times a
// second until ctx ends (a rolling update, one pod at a time, across the
// cluster). It counts the changes made and the ones that failed.
type Churn struct {
	Made, Failed atomic.Int64
	LastError    atomic.Value
}

// Run churns slices (as Populate returned them) with a few requests in
// flight.
func (c *Churn) Run(ctx context.Context, client kubernetes.Interface, spec synth.Spec, slices []*discoveryv1.EndpointSlice, perSecond float64) {
	lim := rate.NewLimiter(rate.Limit(perSecond), 1)
	var mu sync.Mutex
	busy := map[int]bool{}
	next := 0
	var wg sync.WaitGroup
	defer wg.Wait()
	base := spec.EndpointAddr(0, spec.Services*spec.EndpointsPerService)
	for ctx.Err() == nil {
		if err := lim.Wait(ctx); err != nil {
			return
		}
		i := rand.IntN(len(slices))
		mu.Lock()
		if busy[i] {
			mu.Unlock()
			continue
		}
		busy[i] = true
		s := slices[i].DeepCopy()
		k := next
		next = (next + 1) % 4096
		mu.Unlock()
		wg.Add(1)
		go func() {
			defer wg.Done()
			j := rand.IntN(len(s.Endpoints))
			s.Endpoints[j].Addresses = []string{churnAddr(base, k).String()}
			got, err := client.DiscoveryV1().EndpointSlices(s.Namespace).Update(ctx, s, metav1.UpdateOptions{})
			mu.Lock()
			defer mu.Unlock()
			delete(busy, i)
			if err != nil {
				if ctx.Err() == nil {
					c.Failed.Add(1)
					c.LastError.Store(err.Error())
				}
				return
			}
			slices[i] = got
			c.Made.Add(1)
		}()
	}
}

// ProcStat is a process's resource use as the kernel counts it.
type ProcStat struct {
	RSS, PeakRSS int64         // bytes
	CPU          time.Duration // user + system
}

// ReadProcStat reads pid's /proc status and stat.
func ReadProcStat(pid int) (ProcStat, error) {
	var ps ProcStat
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return ps, err
	}
	for _, line := range strings.Split(string(status), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok || (k != "VmRSS" && k != "VmHWM") {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		if err != nil {
			return ps, fmt.Errorf("%s: %q: %w", k, v, err)
		}
		if k == "VmRSS" {
			ps.RSS = kb << 10
		} else {
			ps.PeakRSS = kb << 10
		}
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ps, err
	}
	// Fields after the command name (which may hold spaces) in parentheses.
	s := string(stat)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return ps, fmt.Errorf("short /proc/%d/stat", pid)
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	ps.CPU = time.Duration(ut+st) * time.Second / 100 // USER_HZ is 100 on Linux
	return ps, nil
}
