package iptables_test

import (
	"testing"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// The recaptures run in network namespaces of their own
// (localcluster.NewScratch); Main checks that nothing is left behind.
func TestMain(m *testing.M) { localcluster.Main(m) }
