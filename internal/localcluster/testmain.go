package localcluster

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// RequireEnv, when set to "1" (make test sets it under CI=true), turns the
// loud skip of end-to-end tests on a machine that cannot run them into a
// failure, so a CI run can never pass without them.
const RequireEnv = "PROXYAUDIT_E2E_REQUIRE"

// shared is the package's cluster (Up without Own): the topology of its
// first Up, stopped by Main after the package's tests.
var shared struct {
	once     sync.Once
	nodes    []NodeSpec
	topology Topology
	cluster  *Cluster
	err      error
	skip     string
}

// KubeProxyEnv names another kube-proxy binary for the shared cluster's
// namespace nodes (make fixtures K8S_VERSION=…).
const KubeProxyEnv = "PROXYAUDIT_KUBE_PROXY"

// Main is a TestMain for packages with end-to-end tests. Unless -short,
// -fuzz or -run '^$', the package takes its lane's cluster lock before its first test and
// keeps it to the end: its end-to-end tests run as one block, so one whose
// context is already running never waits for another package's suite
// (the collector's scratch namespaces waited 20 minutes for the real-node
// suite's and failed), and go test's -timeout bounds the wait. The shared
// cluster with the given nodes starts on the first Shared call and is torn
// down after the tests, which then fail if anything of the cluster is left
// on the machine.
func Main(m *testing.M, nodes ...NodeSpec) {
	shared.nodes = nodes
	flag.Parse()
	var release func()
	if err := errors.Join(CanRun(), checkLane()); err == nil && runsTests() {
		logf := func(format string, args ...any) { fmt.Fprintf(os.Stderr, "localcluster: "+format+"\n", args...) }
		if release, err = takeLock(context.Background(), logf); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	if err := CanRun(); err != nil {
		shared.skip = err.Error()
		banner := fmt.Sprintf("\n*** END-TO-END TESTS SKIPPED: %v ***\n*** they need a real local cluster; run `make test` as root on Linux ***\n\n", err)
		fmt.Fprint(os.Stderr, banner)
		if os.Getenv(RequireEnv) == "1" {
			fmt.Fprintf(os.Stderr, "%s=1: refusing to pass without end-to-end tests\n", RequireEnv)
			os.Exit(1)
		}
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sig
		fmt.Fprintln(os.Stderr, "interrupted: tearing down the local cluster")
		shared.cluster.Stop()
		os.Exit(130)
	}()
	code := m.Run()
	if shared.cluster != nil {
		if err := shared.cluster.Stop(); err != nil {
			fmt.Fprintf(os.Stderr, "tear down local cluster: %v\n", err)
			code = 1
		}
		if left := Leftovers(); len(left) > 0 {
			fmt.Fprintf(os.Stderr, "local cluster left these behind:\n  %s\n", strings.Join(left, "\n  "))
			code = 1
		}
	}
	if release != nil {
		release()
	}
	os.Exit(code)
}

// runsTests reports whether this run may run end-to-end tests: not -short
// (make unit, make test's first stage), not a fuzz or benchmark run
// (-run '^$'), which must not wait for the lock while a suite holds it.
func runsTests() bool {
	if testing.Short() {
		return false
	}
	if f := flag.Lookup("test.fuzz"); f != nil && f.Value.String() != "" {
		return false
	}
	if f := flag.Lookup("test.run"); f != nil && f.Value.String() == "^$" {
		return false
	}
	return true
}

// NeedRoot skips t when the machine cannot run what cannot (root,
// iptables, nft; the IPVS VM with vm set), or fails it under
// PROXYAUDIT_E2E_REQUIRE=1 (CI), where skipping would hide that nothing
// ran. In -short mode (make unit) it always skips.
func NeedRoot(t testing.TB, vm bool) {
	t.Helper()
	if testing.Short() {
		t.Skip("needs root: make test runs it")
	}
	err := CanRun()
	if err == nil && vm {
		if err = CanRunVM(); err != nil {
			err = fmt.Errorf("the IPVS VM cannot run: %w", err)
		}
	}
	if err == nil {
		return
	}
	if os.Getenv(RequireEnv) == "1" {
		t.Fatal(err)
	}
	t.Skipf("END-TO-END TEST SKIPPED: %v", err)
}

// BuildForTest builds the proxyaudit binaries into a directory of the
// test's, and returns it.
func BuildForTest(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	if err := BuildProxyaudit(dir); err != nil {
		t.Fatal(err)
	}
	return dir
}

// Shared returns the package's shared cluster of the nodes Main was given:
// Up(t, Topology{Nodes: those}).
func Shared(t testing.TB) *Cluster {
	t.Helper()
	return Up(t, Topology{Nodes: shared.nodes})
}
