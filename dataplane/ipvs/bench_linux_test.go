//go:build linux

package ipvs

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
)

// BenchmarkIPVSRead reads a large IPVS table three ways in one run, each
// reduced to the model: the collector's netlink dump (one services dump, one destinations dump per
// virtual server), bare `ipvsadm -Sn`, and `ipvsadm -Sn` parsed by
// Parse (what a collector forking the tool would pay). It needs
// a kernel with IPVS; an empty table is filled first with
// PROXYAUDIT_BENCH_IPVS_SERVICES virtual servers (default 10,000) of
// PROXYAUDIT_BENCH_IPVS_REAL real servers each (default 10). Run it in a
// network namespace of its own (unshare -n), never beside a live
// kube-proxy: `make bench-ipvs` does so in the IPVS VM.
func BenchmarkIPVSRead(b *testing.B) {
	if _, err := os.Stat("/proc/net/ip_vs"); err != nil {
		b.Skip("no IPVS in this kernel: `make bench-ipvs` runs this benchmark in the VM")
	}
	svcs, reals := envInt("PROXYAUDIT_BENCH_IPVS_SERVICES", 10_000), envInt("PROXYAUDIT_BENCH_IPVS_REAL", 10)
	read := func(t Table) (*audit.Observed, error) {
		vs, err := t.VirtualServers(context.Background())
		if err != nil {
			return nil, err
		}
		return Observed(vs), nil
	}
	t, err := Open()
	if err != nil {
		b.Fatal(err)
	}
	obs, err := read(t)
	t.Close()
	if err != nil {
		b.Fatal(err)
	}
	if obs.NoRules {
		start := time.Now()
		if err := fillIPVS(svcs, reals); err != nil {
			b.Fatal(err)
		}
		b.Logf("filled the table with %d virtual servers x %d real servers in %s", svcs, reals, time.Since(start).Round(time.Millisecond))
	}
	count := func(o *audit.Observed) (int, int) {
		eps := 0
		for _, f := range o.Frontends {
			eps += len(f.Endpoints)
		}
		return len(o.Frontends), eps
	}
	// The collector's reader (mdlayher/genetlink, decoding only what the
	// audit reads) beside moby/ipvs, which it replaced.
	for _, r := range []struct {
		name string
		open func() (Table, error)
	}{{"netlink", Open}, {"netlink-moby", OpenMoby}} {
		b.Run(r.name, func(b *testing.B) {
			t, err := r.open()
			if err != nil {
				b.Fatal(err)
			}
			defer t.Close()
			var o *audit.Observed
			for b.Loop() {
				if o, err = read(t); err != nil {
					b.Fatal(err)
				}
			}
			fe, eps := count(o)
			b.ReportMetric(float64(fe), "virtual-servers")
			b.ReportMetric(float64(eps), "real-servers")
		})
	}
	ipvsadm := func(b *testing.B, parse bool) {
		var tool time.Duration
		var o *audit.Observed
		for b.Loop() {
			cmd := exec.Command("ipvsadm", "-Sn")
			out, err := cmd.StdoutPipe()
			if err != nil {
				b.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				b.Fatal(err)
			}
			if parse {
				o, err = Parse(out)
			} else {
				_, err = io.Copy(io.Discard, out)
			}
			if werr := cmd.Wait(); err != nil || werr != nil {
				b.Fatal(err, werr)
			}
			tool += cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
		}
		b.ReportMetric(float64(tool.Microseconds())/1e3/float64(b.N), "tool-cpu-ms/op")
		if o != nil {
			fe, eps := count(o)
			b.ReportMetric(float64(fe), "virtual-servers")
			b.ReportMetric(float64(eps), "real-servers")
		}
	}
	b.Run("ipvsadm-Sn", func(b *testing.B) { ipvsadm(b, false) })
	b.Run("ipvsadm-Sn+parse", func(b *testing.B) { ipvsadm(b, true) })
}

// fillIPVS programs n virtual servers with m real servers each, in the
// benchmarking range, with one `ipvsadm -R`.
func fillIPVS(n, m int) error {
	var in bytes.Buffer
	for i := range n {
		vip := fmt.Sprintf("198.19.%d.%d:80", i/250, 1+i%250)
		fmt.Fprintf(&in, "-A -t %s -s rr\n", vip)
		for j := range m {
			k := i*m + j
			fmt.Fprintf(&in, "-a -t %s -r 198.18.%d.%d:8080 -m -w 1\n", vip, 128+k/250%128, 1+k%250)
		}
	}
	cmd := exec.Command("ipvsadm", "-R")
	cmd.Stdin = &in
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("ipvsadm -R: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}
