package conntrack

import (
	"testing"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// The reader's tests run on real flows in network namespaces of their own
// (localcluster.NewScratch); Main checks that nothing is left behind.
func TestMain(m *testing.M) { localcluster.Main(m) }
