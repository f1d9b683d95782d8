package localcluster

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// Rules written by a test itself (a node added with NoProxy, a Scratch):
// synthetic kube-proxy rules at scale, loaded, rewritten and churned the
// way kube-proxy writes them, in any network namespace of the machine's.

// netnsCommand returns argv to run inside the named network namespace.
func netnsCommand(ctx context.Context, netns string, argv ...string) *exec.Cmd {
	return exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", netns}, argv...)...)
}

// RestoreIPTablesIn loads an iptables-save dump (one family or both, one
// after the other) into the namespace with iptables-restore and
// ip6tables-restore (their -legacy tools with legacy), replacing the
// tables it names. The nfacct counters its rules name are made first, as
// kube-proxy makes them.
func RestoreIPTablesIn(ctx context.Context, netns string, dump []byte, legacy bool) error {
	if err := InNetNS(netns, func() error { return ensureNFAcct(nfacctNames(dump)) }); err != nil {
		return fmt.Errorf("nfacct counters: %w", err)
	}
	for _, part := range splitDumpFamilies(dump) {
		tool := "iptables-restore"
		if part.v6 {
			tool = "ip6tables-restore"
		}
		if legacy {
			tool = strings.Replace(tool, "-restore", "-legacy-restore", 1)
		}
		cmd := netnsCommand(ctx, netns, tool)
		cmd.Stdin = bytes.NewReader(part.text)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %v: %s", tool, err, out)
		}
	}
	return nil
}

// LoadNFT loads a table listed as `nft -j list table` prints it (synth's
// WriteNFTJSON) into the namespace, in one commit that replaces the
// table's rules when it exists (as kube-proxy's full sync does).
func LoadNFT(ctx context.Context, netns string, listing []byte) error {
	order, err := synth.NFTLoadOrder(listing)
	if err != nil {
		return err
	}
	// Each table made (or kept), then flushed, before the rest is added.
	var doc struct {
		Nftables []map[string]json.RawMessage `json:"nftables"`
	}
	if err := json.Unmarshal(order, &doc); err != nil {
		return err
	}
	var out []any
	for i, o := range doc.Nftables {
		out = append(out, o)
		if _, ok := o["table"]; ok && (i+1 == len(doc.Nftables) || doc.Nftables[i+1]["table"] == nil) {
			for _, u := range doc.Nftables[:i+1] {
				if t := u["table"]; t != nil {
					out = append(out, map[string]any{"flush": map[string]json.RawMessage{"table": t}})
				}
			}
		}
	}
	if order, err = json.Marshal(map[string]any{"nftables": out}); err != nil {
		return err
	}
	cmd := netnsCommand(ctx, netns, "nft", "-j", "-f", "-")
	cmd.Stdin = bytes.NewReader(order)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("nft load: %v: %s", err, out)
	}
	return nil
}

// ChurnConfig says what a Churn writes.
type ChurnConfig struct {
	Spec synth.Spec
	// Mode is iptables (nf_tables backend), iptables-legacy or nftables.
	Mode string
	// Period between the starts of two syncs; each rewrites ten services'
	// chains with the content they have (kube-proxy's partial sync).
	Period time.Duration
	// Dispatch adds kube-proxy's rewrite of KUBE-SERVICES (and
	// KUBE-NODEPORTS) to each iptables sync, as kube-proxy 1.36 does.
	Dispatch bool
	// Rotate is how many services, from the first, the syncs rotate over
	// (0: the first half), so that the rest can be drifted by hand.
	Rotate int
}

// Churn is kube-proxy's partial syncs as a test plays them: every Period,
// ten services' chains rewritten with the content they already have.
type Churn struct {
	// LastSync is the last sync's end, Unix milliseconds: kube-proxy's
	// last-sync time, which a stub of its metrics serves.
	LastSync atomic.Int64
	mu       sync.Mutex
	cpu      time.Duration
	syncs    int
	err      error
	cancel   context.CancelFunc
	wg       sync.WaitGroup
}

// StartChurn starts syncing into the namespace until Stop.
func StartChurn(ctx context.Context, netns string, cfg ChurnConfig) *Churn {
	w := &Churn{}
	w.LastSync.Store(time.Now().UnixMilli())
	wctx, cancel := context.WithCancel(ctx)
	w.cancel = cancel
	rotate := cfg.Rotate
	if rotate <= 0 {
		rotate = max(1, cfg.Spec.Services/2)
	}
	w.wg.Go(func() {
		tick := time.NewTicker(cfg.Period)
		defer tick.Stop()
		for k := 0; ; k++ {
			var in bytes.Buffer
			var svcs []int
			for j := range 10 {
				svcs = append(svcs, (k*10+j)%rotate)
			}
			argv := []string{cfg.Mode + "-restore", "--noflush"}
			var err error
			if cfg.Mode == "nftables" {
				err, argv = cfg.Spec.WriteNFTPartialSync(&in, svcs, netip.AddrPort{}), []string{"nft", "-f", "-"}
			} else {
				err = cfg.Spec.WritePartialSync(&in, svcs, cfg.Dispatch)
			}
			if err == nil {
				cmd := netnsCommand(wctx, netns, argv...)
				cmd.Stdin = &in
				var out []byte
				out, err = cmd.CombinedOutput()
				if wctx.Err() != nil {
					return
				}
				if err != nil {
					err = fmt.Errorf("churn: %s: %v: %s", strings.Join(argv, " "), err, out)
				} else {
					w.LastSync.Store(time.Now().UnixMilli())
					w.mu.Lock()
					w.cpu += cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
					w.syncs++
					w.mu.Unlock()
				}
			}
			if err != nil {
				w.mu.Lock()
				w.err = err
				w.mu.Unlock()
				return
			}
			select {
			case <-wctx.Done():
				return
			case <-tick.C:
			}
		}
	})
	return w
}

// Stop ends the churn and returns the error that stopped it early, if any.
func (w *Churn) Stop() error {
	w.cancel()
	w.wg.Wait()
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

// Done says how much CPU the syncs spent and how many were made.
func (w *Churn) Done() (time.Duration, int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.cpu, w.syncs
}
