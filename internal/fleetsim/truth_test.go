package fleetsim

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// The simulated kube-proxies' incremental versions equal a reduction of
// the whole cluster from scratch, under a stream of endpoint changes.
func TestTruthFollowsTheCluster(t *testing.T) {
	spec := synth.Spec{Services: 50, EndpointsPerService: 4}
	svcs, sl := spec.Objects()
	client := fake.NewClientset(spec.APIObjects()...)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	truth := NewTruth(client, time.Minute)
	truth.Run(ctx, 20*time.Millisecond)
	rng := rand.New(rand.NewPCG(3, 4))
	want := func() uint64 {
		el, _ := client.DiscoveryV1().EndpointSlices(synth.Namespace).List(ctx, metav1.ListOptions{})
		return stream.FromModel(synth.Rules(audit.FromAPI(svcs, el.Items, nil))).Root()
	}
	for round := range 20 {
		for range 1 + rng.IntN(8) {
			i := rng.IntN(len(sl))
			s, err := client.DiscoveryV1().EndpointSlices(synth.Namespace).Get(ctx, sl[i].Name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			s.Endpoints[rng.IntN(len(s.Endpoints))].Addresses = []string{fmt.Sprintf("198.18.200.%d", rng.IntN(250))}
			if _, err := client.DiscoveryV1().EndpointSlices(synth.Namespace).Update(ctx, s, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		w := want()
		deadline := time.Now().Add(5 * time.Second)
		for truth.Latest().State.Root() != w {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: the newest version never matched the cluster", round)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}
