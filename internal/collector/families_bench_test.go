//go:build linux

package collector

import (
	"bytes"
	"context"
	"testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/nftables"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// BenchmarkIPv6Half is what reading the IPv6 half costs on a single-stack
// node, whose kube-proxy keeps empty IPv6 tables: the read of both
// families beside the IPv4 read alone, on one table of 10k services × 10
// endpoints (PROXYAUDIT_BENCH_SMALL=1: 1k × 10), side by side in one run.
// iptables: a second tool run (ip6tables-save of an empty nat table);
// nftables over netlink: a lookup of a table that is not there.
func BenchmarkIPv6Half(b *testing.B) {
	if err := localcluster.CanRun(); err != nil {
		b.Skipf("needs root, iptables and nft: %v", err)
	}
	spec, ipt, nftLoad := benchRules(b)
	ctx := context.Background()
	for _, m := range []struct {
		name string
		load []string
		data []byte
		// v4 reads IPv4 alone; both reads as the collector does.
		v4, both func(h *Host) func() (*audit.Observed, error)
	}{
		{"iptables", []string{"iptables-restore"}, ipt,
			func(h *Host) func() (*audit.Observed, error) {
				r := &toolReader{src: Source{Mode: audit.ModeIPTables}, exec: h, argv: []string{"iptables-save", "-t", "nat"}, fam: 4}
				return func() (*audit.Observed, error) { return r.Read(ctx) }
			},
			func(h *Host) func() (*audit.Observed, error) {
				r := h.Reader(Source{Mode: audit.ModeIPTables})
				return func() (*audit.Observed, error) { return r.Read(ctx) }
			}},
		{"nftables", []string{"nft", "-j", "-f", "-"}, nftLoad,
			func(*Host) func() (*audit.Observed, error) {
				r := nftables.NewNetlinkReader()
				return func() (*audit.Observed, error) { return r.ReadFamily(ctx, 4) }
			},
			func(h *Host) func() (*audit.Observed, error) {
				r := h.Reader(Source{Mode: audit.ModeNFTables})
				return func() (*audit.Observed, error) { return r.Read(ctx) }
			}},
	} {
		ns, err := localcluster.NewScratch(ctx, "v6half")
		if err != nil {
			b.Fatal(err)
		}
		load := ns.Command(ctx, m.load...)
		load.Stdin = bytes.NewReader(m.data)
		if out, err := load.CombinedOutput(); err != nil {
			ns.Close()
			b.Fatalf("load: %v: %s", err, out)
		}
		for _, variant := range []struct {
			name string
			read func(h *Host) func() (*audit.Observed, error)
		}{{"ipv4-alone", m.v4}, {"both-families", m.both}} {
			b.Run(m.name+"/"+variant.name, func(b *testing.B) {
				err := localcluster.InNetNS(ns.NetNS, func() error {
					read := variant.read(NewHost())
					for b.Loop() {
						obs, err := read()
						if err != nil {
							return err
						}
						if len(obs.Frontends) != spec.Services {
							b.Fatalf("read %d frontends, want %d", len(obs.Frontends), spec.Services)
						}
					}
					return nil
				})
				if err != nil {
					b.Fatal(err)
				}
			})
		}
		ns.Close()
	}
}
