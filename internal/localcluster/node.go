package localcluster

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Exec runs argv inside the node's network namespace.
func (n *Node) Exec(ctx context.Context, argv ...string) (string, error) {
	return run(ctx, append([]string{"ip", "netns", "exec", n.NetNS}, argv...)...)
}

// iptables returns the iptables binary name for the node's backend with the
// given suffix ("", "-save", "-restore").
func (n *Node) iptables(suffix string) string {
	if n.Legacy {
		return "iptables-legacy" + suffix
	}
	return "iptables" + suffix
}

// Rules returns the node's kube-proxy rules of both IP families as the
// tools an SRE would run print them: `iptables-save -t nat` followed by
// `ip6tables-save -t nat` in iptables mode, `nft -j list ruleset` (kube-
// proxy's ip and ip6 tables) in nftables mode.
func (n *Node) Rules(ctx context.Context) (string, error) {
	if n.Mode == ModeCilium {
		return n.ciliumRules()
	}
	if n.Mode == ModeNFTables {
		return n.Exec(ctx, "nft", "-j", "list", "ruleset")
	}
	v4, err := n.Exec(ctx, n.iptables("-save"), "-t", "nat")
	if err != nil {
		return "", err
	}
	v6, err := n.Exec(ctx, n.ip6tables("-save"), "-t", "nat")
	if err != nil {
		return "", err
	}
	return v4 + v6, nil
}

// ip6tables is iptables for IPv6.
func (n *Node) ip6tables(suffix string) string { return "ip6" + n.iptables(suffix)[2:] }

// StartProxy starts kube-proxy on the node (again) and waits until it has
// programmed default/kubernetes.
func (n *Node) StartProxy(ctx context.Context) error {
	p, err := n.startProxy()
	if err != nil {
		return err
	}
	ready := n.proxyReady
	if ready <= 0 {
		ready = 60 * time.Second
		if n.Mode == ModeCilium {
			ready = ciliumReady
		}
	}
	what := "kube-proxy rules on " + n.Name
	if n.Mode == ModeCilium {
		// The maps outlive the agent: a restarted one is ready when its
		// API answers, not when the last one's entries are there.
		what = "Cilium agent's maps on " + n.Name
	}
	return n.c.waitProcess(ctx, p, ready, what, func() bool {
		if n.Mode == ModeCilium && !n.agentAnswers() {
			return false
		}
		rules, err := n.Rules(ctx)
		return err == nil && n.RoutesTo(rules, n.c.KubernetesEndpoint())
	})
}

// startProxy starts the kube-proxy process without waiting for its rules.
func (n *Node) startProxy() (*process, error) {
	n.mu.Lock()
	if n.proxy != nil && !n.proxy.exited() {
		n.mu.Unlock()
		return nil, fmt.Errorf("kube-proxy already runs on %s", n.Name)
	}
	if n.Mode == ModeCilium {
		p, err := n.startAgent()
		if err == nil {
			n.proxy = p
		}
		n.mu.Unlock()
		return p, err
	}
	argv := []string{"ip", "netns", "exec", n.NetNS}
	if n.Legacy {
		dir, err := n.c.legacyBin()
		if err != nil {
			n.mu.Unlock()
			return nil, err
		}
		argv = append(argv, "env", "PATH="+dir+":"+os.Getenv("PATH"))
	}
	argv = append(argv,
		n.c.kubeProxy(),
		"--kubeconfig="+n.c.proxyKubeconfig,
		"--proxy-mode="+string(n.Mode),
		"--hostname-override="+n.Name,
		"--conntrack-max-per-core=0",
		"--cluster-cidr="+n.c.podCIDRs(),
		"--healthz-bind-address=0.0.0.0:10256",
		"--metrics-bind-address=127.0.0.1:10249",
		"--v=2",
	)
	p, err := startProcess("kube-proxy["+n.Name+"]", filepath.Join(n.c.Dir, "kube-proxy-"+n.Name+".log"), argv)
	if err != nil {
		n.mu.Unlock()
		return nil, err
	}
	n.proxy = p
	n.mu.Unlock()
	return p, nil
}

// RoutesTo reports whether rules (as returned by Rules) DNAT to ip:port. It
// is a coarse text check for the harness's own waits, not the audit: in
// iptables mode a DNAT rule must name it; kube-proxy 1.36 in nftables mode
// DNATs from the service chain through a numgen map of [ip, port] pairs, or
// from a per-endpoint chain when it needs one (session affinity).
func (n *Node) RoutesTo(rules, ipPort string) bool {
	if n.Mode == ModeCilium {
		return ciliumRoutesTo(rules, ipPort)
	}
	if n.Mode == ModeNFTables {
		ip, port, _ := net.SplitHostPort(ipPort)
		return strings.Contains(rules, `{"concat": ["`+ip+`", `+port+`]}`) ||
			strings.Contains(rules, `"addr": "`+ip+`", "port": `+port)
	}
	return strings.Contains(rules, "-j DNAT --to-destination "+ipPort)
}

// RouteCount is how many of the node's rules (as Rules returns them) DNAT
// to ipPort: one per service port that reaches it (kube-dns's dns and
// dns-tcp: two). A Cilium node's map has one entry per address: 1 or 0.
func (n *Node) RouteCount(rules, ipPort string) int {
	switch n.Mode {
	case ModeCilium:
		if ciliumRoutesTo(rules, ipPort) {
			return 1
		}
		return 0
	case ModeNFTables:
		ip, port, _ := net.SplitHostPort(ipPort)
		return strings.Count(rules, `{"concat": ["`+ip+`", `+port+`]}`) + strings.Count(rules, `"addr": "`+ip+`", "port": `+port)
	}
	return strings.Count(rules, "-j DNAT --to-destination "+ipPort)
}

// StopProxy stops the node's kube-proxy (SIGTERM, then SIGKILL). Its rules
// stay in the kernel, as they do when a real kube-proxy pod is deleted.
func (n *Node) StopProxy() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.proxy.stop(5 * time.Second)
}

// RestartProxy stops kube-proxy and starts a new one, as deleting the
// kube-proxy pod of a DaemonSet does.
func (n *Node) RestartProxy(ctx context.Context) error {
	n.StopProxy()
	return n.StartProxy(ctx)
}

// ProxyPID returns the pid of the node's kube-proxy, or 0.
func (n *Node) ProxyPID() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.proxy == nil || n.proxy.exited() {
		return 0
	}
	return n.proxy.cmd.Process.Pid
}

// ProxyLog returns the path of the node's kube-proxy log.
func (n *Node) ProxyLog() string {
	return filepath.Join(n.c.Dir, "kube-proxy-"+n.Name+".log")
}

// Livez returns the HTTP status of kube-proxy's :10256/livez, as a kubelet
// liveness probe would see it.
func (n *Node) Livez(ctx context.Context) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+n.IP+":10256/livez", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

// WaitRules polls the node's rules until cond holds or timeout passes; the
// error includes the last rules seen.
func (n *Node) WaitRules(ctx context.Context, timeout time.Duration, what string, cond func(rules string) bool) error {
	var last string
	err := n.c.waitProcess(ctx, nil, timeout, what+" on "+n.Name, func() bool {
		r, err := n.Rules(ctx)
		if err != nil {
			return false
		}
		last = r
		return cond(r)
	})
	if err != nil {
		if len(last) > 4000 {
			last = last[:4000] + "…(cut)"
		}
		return fmt.Errorf("%w; last rules:\n%s", err, last)
	}
	return nil
}

// legacyBin makes a directory whose iptables* entries are the legacy
// x_tables backend, so that a kube-proxy with it first on PATH programs
// legacy rules.
func (c *Cluster) legacyBin() (string, error) {
	dir := filepath.Join(c.Dir, "legacy-bin")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	multi, err := lookPath("xtables-legacy-multi")
	if err != nil {
		return "", fmt.Errorf("legacy iptables backend: %w", err)
	}
	for _, name := range []string{"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore"} {
		link := filepath.Join(dir, name)
		if _, err := os.Lstat(link); err == nil {
			continue
		}
		if err := os.Symlink(multi, link); err != nil {
			return "", err
		}
	}
	return dir, nil
}

// apiServerBinary is the kube-apiserver binary the cluster runs.
func (c *Cluster) apiServerBinary() string {
	if c.cfg.APIServer != "" {
		return c.cfg.APIServer
	}
	return filepath.Join(c.bin, "kube-apiserver")
}

// kubeProxy is the kube-proxy binary namespace nodes and VM nodes run.
func (c *Cluster) kubeProxy() string {
	if c.cfg.KubeProxy != "" {
		return c.cfg.KubeProxy
	}
	return filepath.Join(c.bin, "kube-proxy")
}
