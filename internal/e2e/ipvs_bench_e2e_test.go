package e2e

import (
	"context"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

var ipvsBench = flag.String("ipvs-bench", "", "run dataplane/ipvs's BenchmarkIPVSRead in the IPVS VM with these -test.bench arguments (make bench-ipvs)")

// TestIPVSBenchmarkInVM runs the IPVS read benchmark where IPVS exists: it
// compiles dataplane/ipvs's test binary and runs BenchmarkIPVSRead in
// the VM, in a network namespace of its own, and prints go test's output.
// It is not a timed test: it only carries the benchmark to the kernel.
func TestIPVSBenchmarkInVM(t *testing.T) {
	if *ipvsBench == "" {
		t.Skip("runs only with -ipvs-bench (make bench-ipvs)")
	}
	if err := localcluster.CanRunVM(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	root, err := localcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "ipvs.test")
	build := exec.Command("go", "test", "-c", "-o", bin, "./dataplane/ipvs")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the benchmark: %v\n%s", err, out)
	}
	vm, err := localcluster.BootVM(ctx, "bench", filepath.Join(dir, "vm"), t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Stop()
	// A fresh network namespace has no routes, and IPVS refuses a real
	// server whose address is not unicast there: route the benchmark's
	// range to a dummy interface first.
	script := "ip link set lo up && ip link add bench0 type dummy && ip link set bench0 up && ip route add 198.18.0.0/15 dev bench0 && " +
		bin + " -test.run '^$' -test.bench BenchmarkIPVSRead -test.benchmem " + *ipvsBench
	out, err := vm.RunFor(ctx, 35*time.Minute, "cd "+dir+" && unshare -n sh -c "+shellQuote(script))
	os.Stdout.WriteString(out + "\n")
	if err != nil {
		t.Fatal(err)
	}
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
