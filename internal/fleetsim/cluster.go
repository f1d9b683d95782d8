package fleetsim

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
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
	startWorkers := func() {
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
	}
	startWorkers()
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
		if !send(func() error { return CreateNode(ctx, client, name(i), i) }) {
			break
		}
	}
	for i := range svcs {
		if !send(func() error {
			got, err := client.CoreV1().Services(synth.Namespace).Create(ctx, &svcs[i], metav1.CreateOptions{})
			if err != nil {
				return fmt.Errorf("create service %s: %w", svcs[i].Name, err)
			}
			svcs[i].UID = got.UID
			return nil
		}) {
			break
		}
	}
	// Slices name their Service as owner, as the controller's do: wait
	// for every Service first.
	close(jobs)
	wg.Wait()
	jobs = make(chan func() error)
	startWorkers()
	for i := range sl {
		controllerLike(&sl[i], &svcs[i/max(1, len(sl)/len(svcs))], n, name)
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

// controllerLike dresses a synthetic slice as the EndpointSlice controller
// writes one: owner, labels, trigger-time annotation, and per endpoint its
// conditions, pod reference, node and zone. The aggregator's informer sees
// objects of the real size (its Trim transform drops most of this).
func controllerLike(s *discoveryv1.EndpointSlice, svc *corev1.Service, nodes int, name func(int) string) {
	yes, no := true, false
	s.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Service", Name: svc.Name, UID: svc.UID, Controller: &yes, BlockOwnerDeletion: &yes}}
	s.Labels["endpointslice.kubernetes.io/managed-by"] = "endpointslice-controller.k8s.io"
	s.Annotations = map[string]string{"endpoints.kubernetes.io/last-change-trigger-time": time.Now().UTC().Format(time.RFC3339)}
	for j := range s.Endpoints {
		e := &s.Endpoints[j]
		pod := fmt.Sprintf("%s-7d4b9c8f6-%05d", svc.Name, j)
		node := name(rand.IntN(max(1, nodes)))
		zone := fmt.Sprintf("zone-%c", 'a'+rand.IntN(3))
		e.Conditions = discoveryv1.EndpointConditions{Ready: &yes, Serving: &yes, Terminating: &no}
		e.TargetRef = &corev1.ObjectReference{Kind: "Pod", Namespace: s.Namespace, Name: pod, UID: types.UID(fmt.Sprintf("%08x-0000-4000-8000-%012x", rand.Uint32(), rand.Uint64()>>16))}
		if nodes > 0 {
			e.NodeName = &node
		}
		e.Zone = &zone
	}
}

// CreateNode registers a node with the status a kubelet writes (Ready,
// addresses, system info, images), the size the aggregator's informer
// holds for each node before its Trim transform.
func CreateNode(ctx context.Context, client kubernetes.Interface, name string, i int) error {
	n, err := client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
		"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "topology.kubernetes.io/zone": fmt.Sprintf("zone-%c", 'a'+i%3),
	}}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create node %s: %w", name, err)
	}
	now := metav1.Now()
	n.Status.Conditions = []corev1.NodeCondition{
		{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", Message: "kubelet is posting ready status", LastHeartbeatTime: now, LastTransitionTime: now},
		{Type: corev1.NodeMemoryPressure, Status: corev1.ConditionFalse, Reason: "KubeletHasSufficientMemory", LastHeartbeatTime: now, LastTransitionTime: now},
		{Type: corev1.NodeDiskPressure, Status: corev1.ConditionFalse, Reason: "KubeletHasNoDiskPressure", LastHeartbeatTime: now, LastTransitionTime: now},
		{Type: corev1.NodePIDPressure, Status: corev1.ConditionFalse, Reason: "KubeletHasSufficientPID", LastHeartbeatTime: now, LastTransitionTime: now},
	}
	// The address its simulated collector connects from (fleet.go), as a
	// collector on the host network does.
	n.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: fmt.Sprintf("127.%d.%d.%d", 64+(i>>16&63), i>>8&255, i&255)}, {Type: corev1.NodeHostName, Address: name}}
	n.Status.NodeInfo = corev1.NodeSystemInfo{KernelVersion: "6.1.0-56-amd64", OSImage: "Debian GNU/Linux 12 (bookworm)", ContainerRuntimeVersion: "containerd://1.7.24",
		KubeletVersion: "v1.36.3", OperatingSystem: "linux", Architecture: "amd64", MachineID: fmt.Sprintf("%032x", i), SystemUUID: fmt.Sprintf("%08x-0000-0000-0000-000000000000", i), BootID: fmt.Sprintf("%08x-0000-0000-0000-000000000001", i)}
	for k := range 20 {
		n.Status.Images = append(n.Status.Images, corev1.ContainerImage{
			Names:     []string{fmt.Sprintf("registry.example.com/team-%d/app@sha256:%064x", k, k), fmt.Sprintf("registry.example.com/team-%d/app:v1.%d.0", k, k)},
			SizeBytes: int64(50+k) << 20})
	}
	if _, err := client.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("node %s status: %w", name, err)
	}
	return nil
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
		s := spec.Replaced(*slices[i], rand.IntN(len(slices[i].Endpoints)), next)
		next = (next + 1) % 4096
		mu.Unlock()
		// As the EndpointSlice controller does: kube-proxy measures its
		// network programming latency from this.
		s.Annotations = map[string]string{"endpoints.kubernetes.io/last-change-trigger-time": time.Now().UTC().Format(time.RFC3339Nano)}
		wg.Add(1)
		go func() {
			defer wg.Done()
			got, err := client.DiscoveryV1().EndpointSlices(s.Namespace).Update(ctx, &s, metav1.UpdateOptions{})
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
