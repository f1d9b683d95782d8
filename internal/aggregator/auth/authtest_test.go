package auth_test

import (
	"testing"

	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth/authtest"
)

// The fake API server binds tokens to nodes as the real one does, under
// the extra field the aggregator reads.
func TestAuthtestNamesTheNodeAsTheAPIServerDoes(t *testing.T) {
	if authtest.NodeNameExtra != auth.NodeNameExtra {
		t.Fatalf("authtest binds nodes under %q, the aggregator reads %q", authtest.NodeNameExtra, auth.NodeNameExtra)
	}
}
