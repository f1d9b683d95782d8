package fleetsim

import (
	"bytes"
	"context"
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/collector"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

var _ collector.Node = (*simNode)(nil)

func version(t *testing.T, seq uint64, services int) *Version {
	t.Helper()
	o, err := synth.Spec{Services: services, EndpointsPerService: 3}.Observed()
	if err != nil {
		t.Fatal(err)
	}
	return &Version{Seq: seq, State: stream.FromModel(o)}
}

// The simulated nodes write one shared encoding for every node making the
// same move between two versions, with each node's own seq and kube-proxy
// spliced in. What arrives must be what the collector's stream.Write of
// the same report sends, and must move the aggregator's copy to the
// node's version.
func TestSharedFramesAreTheCollectorsReports(t *testing.T) {
	ctx := context.Background()
	v1, v2 := version(t, 1, 20), version(t, 2, 23)
	for _, refs := range []bool{false, true} {
		t.Run(fmt.Sprintf("refs=%v", refs), func(t *testing.T) {
			f := NewFleet(nil, nil, 2, func(i int) string { return fmt.Sprintf("n%d", i) }, 10*time.Second, 0, 0)
			agg := stream.NewState()
			var moves []*transition
			for i, n := range f.nodes {
				sent := stream.NewState()
				for step, v := range []*Version{v1, v2, v2} {
					n.frozen = v
					why := stream.ReadHeartbeat
					if step == 0 {
						why = stream.ReadResync
					}
					r := n.Report(ctx, sent, step == 0, why, refs)
					if r.Seq != uint64(step+1) || r.KubeProxy == nil {
						t.Fatalf("node %d step %d: seq %d, kube-proxy %v: want the node's own", i, step, r.Seq, r.KubeProxy)
					}
					if sent.Root() != v.State.Root() {
						t.Fatalf("node %d step %d: sent is not the version reported", i, step)
					}
					m := &stream.Message{Type: stream.TypeReport, Report: r}
					frame, err := n.frame(m)
					if err != nil {
						t.Fatal(err)
					}
					var want bytes.Buffer
					if err := stream.Write(&want, m); err != nil {
						t.Fatal(err)
					}
					got, _, err := stream.Read(bytes.NewReader(frame), 1<<24)
					if err != nil {
						t.Fatalf("node %d step %d: the shared frame does not read: %v", i, step, err)
					}
					exp, _, _ := stream.Read(&want, 1<<24)
					if !reflect.DeepEqual(got, exp) {
						t.Fatalf("node %d step %d: the shared frame reads as\n%+v\nthe collector's as\n%+v", i, step, got.Report, exp.Report)
					}
					if i == 0 && !refs {
						if ok, err := agg.Apply(got.Report); err != nil || !ok {
							t.Fatalf("step %d: the aggregator's copy does not follow: %v %v", step, ok, err)
						}
					}
					if i == 0 {
						moves = append(moves, n.t)
					} else if n.t != moves[step] {
						t.Errorf("step %d: node 1 encoded its move again instead of sharing node 0's", step)
					}
				}
			}
			if !refs && agg.Root() != v2.State.Root() {
				t.Error("the aggregator's copy is not the last version")
			}
		})
	}
}
