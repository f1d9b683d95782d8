package collector

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// changeReader reads the whole rules first, then only what changed:
// nothing, as on a node whose kube-proxy stopped writing.
type changeReader struct {
	obs   *audit.Observed
	bytes int64
}

func (r *changeReader) String() string { return "fake" }
func (r *changeReader) Read(context.Context) (*audit.Observed, error) {
	r.bytes = 1 << 20
	return r.obs, nil
}
func (r *changeReader) ReadChanges(ctx context.Context) (*audit.Changes, error) {
	r.bytes = 0
	return &audit.Changes{Mode: r.obs.Mode, Families: r.obs.Families}, nil
}
func (r *changeReader) BytesRead() int64 { return r.bytes }

// The read stats keep the last whole read's cost beside the last read's:
// on a stuck node the last read is an incremental one that read nothing,
// and "0 bytes" alone hides what reading the node costs (issue #57).
func TestReadStatsKeepTheLastWholeRead(t *testing.T) {
	r := &changeReader{obs: &audit.Observed{Mode: audit.ModeNFTables, Families: []int{4}}}
	c := &client{cfg: Config{Log: zap.NewNop(), Clock: clock.RealClock{}, FullReadInterval: time.Hour, Interval: 10 * time.Second},
		credit: newReadCredit(DefaultReadBudget, time.Second, 10*time.Second), reader: r}
	c.cost.Reads = map[stream.ReadReason]uint64{}
	ctx := context.Background()
	if err := c.read(ctx, stream.ReadResync); err != nil {
		t.Fatal(err)
	}
	first := c.stats()
	if first.LastBytes != 1<<20 || first.WholeBytes != 1<<20 || first.WholeSeconds != first.LastSeconds {
		t.Fatalf("after a whole read: %+v", first)
	}
	if err := c.read(ctx, stream.ReadChange); err != nil {
		t.Fatal(err)
	}
	rs := c.stats()
	if rs.LastBytes != 0 || rs.WholeBytes != 1<<20 || rs.WholeSeconds != first.WholeSeconds || rs.WholeCPUSeconds != first.WholeCPUSeconds {
		t.Errorf("after an incremental read: last %d bytes, whole %d bytes %gs (want the first read's %gs)", rs.LastBytes, rs.WholeBytes, rs.WholeSeconds, first.WholeSeconds)
	}
	if err := rs.Validate(); err != nil {
		t.Error(err)
	}
	rs.WholeBytes = -1
	if rs.Validate() == nil {
		t.Error("a negative whole read was valid")
	}
}
