// Package buildinfo is what a binary says about its own build: the
// release's version, the commit and the commit's date, stamped by `make
// release` with -ldflags -X; a plain `go build` says (devel) and takes the
// commit from the Go toolchain's VCS stamp where it has one.
package buildinfo

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
)

// Set by the release's linker flags (deploy/release): -X
// github.com/proxyaudit/proxyaudit/internal/buildinfo.version=v0.1.0 and
// likewise commit and date.
var (
	version = ""
	commit  = ""
	date    = ""
)

// Devel is the version of a binary no release stamped.
const Devel = "(devel)"

// Info is one binary's build.
type Info struct {
	Version string `json:"version"`
	Commit  string `json:"commit,omitempty"`
	Date    string `json:"date,omitempty"`
	Go      string `json:"go"`
}

// Get returns this binary's build.
func Get() Info {
	i := Info{Version: version, Commit: commit, Date: date, Go: runtime.Version()}
	if i.Version == "" {
		i.Version = Devel
	}
	if i.Commit == "" {
		if bi, ok := debug.ReadBuildInfo(); ok {
			for _, s := range bi.Settings {
				switch s.Key {
				case "vcs.revision":
					i.Commit = s.Value
				case "vcs.time":
					i.Date = s.Value
				}
			}
		}
	}
	return i
}

// Version is the release's version, or Devel.
func Version() string { return Get().Version }

// String is the line `version` prints: "NAME v0.1.0 (commit abc123…, 2026-12-02T10:00:00Z, go1.26.8)".
func (i Info) String() string {
	var b strings.Builder
	b.WriteString(i.Version)
	var extra []string
	if i.Commit != "" {
		extra = append(extra, "commit "+i.Commit)
	}
	if i.Date != "" {
		extra = append(extra, i.Date)
	}
	extra = append(extra, i.Go)
	fmt.Fprintf(&b, " (%s)", strings.Join(extra, ", "))
	return b.String()
}

// Collector is proxyaudit_build_info{version,revision,goversion}: 1, the
// gauge Prometheus' own servers export, so dashboards can join a rolling
// upgrade's progress to everything else.
func Collector() prometheus.Collector {
	i := Get()
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "proxyaudit_build_info",
		Help:        "A metric with a constant '1' value labelled by the version, revision and Go version proxyaudit was built from.",
		ConstLabels: prometheus.Labels{"version": i.Version, "revision": i.Commit, "goversion": i.Go},
	})
	g.Set(1)
	return g
}

// LDFlags are the linker flags that stamp a build with a release's version,
// commit and date.
func LDFlags(version, commit, date string) []string {
	const pkg = "github.com/proxyaudit/proxyaudit/internal/buildinfo"
	return []string{"-X", pkg + ".version=" + version, "-X", pkg + ".commit=" + commit, "-X", pkg + ".date=" + date}
}
