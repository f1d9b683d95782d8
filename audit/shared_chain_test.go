package audit_test

import (
	"testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/testkit/readertest"
)

// TestSharedPolicyChainsCostLinearMemory: n service-ips elements going to
// one service chain whose numgen map has n endpoints cost in proportion to
// the dump, not n² (iptables': dataplane/iptables).
func TestSharedPolicyChainsCostLinearMemory(t *testing.T) {
	readertest.LinearMemory(t, readertest.SharedChainNFT, audit.ParseNFTables)
}
