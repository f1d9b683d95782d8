package buildinfo

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestUnstampedIsDevel(t *testing.T) {
	i := Get()
	if i.Version != Devel {
		t.Fatalf("version %q, want %q in a test binary", i.Version, Devel)
	}
	if !strings.HasPrefix(i.String(), Devel+" (") || !strings.Contains(i.String(), i.Go) {
		t.Errorf("String() = %q", i.String())
	}
}

func TestBuildInfoMetric(t *testing.T) {
	r := prometheus.NewRegistry()
	r.MustRegister(Collector())
	want := `# HELP proxyaudit_build_info A metric with a constant '1' value labelled by the version, revision and Go version proxyaudit was built from.
# TYPE proxyaudit_build_info gauge
proxyaudit_build_info{goversion="` + Get().Go + `",revision="` + Get().Commit + `",version="(devel)"} 1
`
	if err := testutil.GatherAndCompare(r, strings.NewReader(want), "proxyaudit_build_info"); err != nil {
		t.Error(err)
	}
}

// The linker flags the release passes reach the binary: a program built
// with them prints what they say.
func TestStampedByTheLinker(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a program")
	}
	bin := filepath.Join(t.TempDir(), "v")
	cmd := exec.Command("go", "build", "-trimpath", "-buildvcs=false", "-ldflags", strings.Join(LDFlags("v1.2.3", "0123abc", "2026-12-02T10:00:00Z"), " "), "-o", bin, "./testdata/stamped")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatal(err)
	}
	if want := "v1.2.3 (commit 0123abc, 2026-12-02T10:00:00Z, "; !strings.HasPrefix(string(out), want) {
		t.Errorf("stamped binary says %q, want it to begin %q", out, want)
	}
}
