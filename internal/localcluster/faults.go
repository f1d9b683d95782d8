package localcluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Undo reverses a fault.
type Undo func(ctx context.Context) error

// HangInformer drops both directions of the node's traffic with the API
// server inside its namespace. kube-proxy keeps running and its /livez stays
// 200, but it sees no more changes: the field failure behind stale rules.
// (Dropping only OUTPUT still lets some watch data in.)
func (n *Node) HangInformer(ctx context.Context) (Undo, error) {
	ip, port := n.c.in.apiIP, strconv.Itoa(n.c.in.apiPort)
	rules := [][]string{
		{"OUTPUT", "-d", ip, "-p", "tcp", "--dport", port, "-j", "DROP"},
		{"INPUT", "-s", ip, "-p", "tcp", "--sport", port, "-j", "DROP"},
	}
	return n.insertFilterRules(ctx, rules)
}

// HangProxyWatch hangs only kube-proxy's traffic with the API server, for
// as long as the fault lasts, on a real kubelet node: packets of sockets
// in kube-proxy's pod's cgroup (the kernel's cgroup match, on the unified
// hierarchy) to and from the API server are dropped. kube-proxy keeps
// running and serving its metrics, which show it in sync with what it
// last heard; client-go's health check closes the dead connection after
// ~45 s, and the new one never opens. HangInformer would cut the kubelet
// too on a real node (it shares the node's network), and
// DropAPIConnection heals itself once the connection is replaced.
func (n *Node) HangProxyWatch(ctx context.Context) (Undo, error) {
	if n.real == nil {
		return nil, fmt.Errorf("%s is not a kubelet node: HangInformer hangs a namespace node's kube-proxy", n.Name)
	}
	pid := n.podProxyPID()
	if pid == 0 {
		return nil, fmt.Errorf("kube-proxy is not running on %s", n.Name)
	}
	path, err := unifiedCgroup(pid)
	if err != nil {
		return nil, fmt.Errorf("kube-proxy on %s: %w", n.Name, err)
	}
	ip, port := n.c.in.apiIP, strconv.Itoa(n.c.in.apiPort)
	rules := [][]string{
		{"OUTPUT", "-d", ip, "-p", "tcp", "--dport", port, "-m", "cgroup", "--path", path, "-j", "DROP"},
		// For an established socket the input hook knows it (early demux).
		{"INPUT", "-s", ip, "-p", "tcp", "--sport", port, "-m", "cgroup", "--path", path, "-j", "DROP"},
	}
	undo, err := n.insertFilterRules(ctx, rules)
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context) error {
		err := undo(ctx)
		root := "/sys/fs/cgroup/unified" // a hybrid host's; a v2-only host mounts it at /sys/fs/cgroup
		if _, err := os.Stat(root); err != nil {
			root = "/sys/fs/cgroup"
		}
		if _, gone := os.Stat(filepath.Join(root, path)); err != nil && os.IsNotExist(gone) {
			// kube-proxy's container is gone (restarted): its rules match
			// nothing any more, whether or not they could be removed.
			return nil
		}
		return err
	}, nil
}

// unifiedCgroup is pid's cgroup on the unified (v2) hierarchy, refused
// when it is the root (it would match every process of the host, the
// kubelet's too).
func unifiedCgroup(pid int) (string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			if p == "/" || p == "" {
				return "", fmt.Errorf("its cgroup on the unified hierarchy is the root, which every process shares")
			}
			return p, nil
		}
	}
	return "", fmt.Errorf("no cgroup on the unified hierarchy:\n%s", b)
}

// DropAPIConnection drops only kube-proxy's established connection to the API
// server (matched on its local port), in both directions. Unlike
// HangInformer, a restarted kube-proxy opens a new connection and recovers:
// this is the dead-HTTP/2-connection failure that a restart cures.
func (n *Node) DropAPIConnection(ctx context.Context) (Undo, error) {
	// kube-proxy in a pod (a real node) is found by its name; the
	// harness's own by its process.
	match := `(("kube-proxy",`
	who := "kube-proxy's pod"
	if n.real == nil {
		pid := n.ProxyPID()
		if pid == 0 {
			return nil, fmt.Errorf("kube-proxy is not running on %s", n.Name)
		}
		match, who = "pid="+strconv.Itoa(pid)+",", fmt.Sprintf("kube-proxy (pid %d)", pid)
	}
	ip, port := n.c.in.apiIP, strconv.Itoa(n.c.in.apiPort)
	out, err := n.Exec(ctx, "ss", "-tnpH", "state", "established", "( dport = :"+port+" )")
	if err != nil {
		return nil, err
	}
	var rules [][]string
	for _, line := range strings.Split(out, "\n") {
		if !strings.Contains(line, match) {
			continue
		}
		f := strings.Fields(line)
		if len(f) < 4 {
			continue
		}
		local := f[2] // Recv-Q Send-Q Local Peer (state omitted with a filter)
		i := strings.LastIndexByte(local, ':')
		if i < 0 {
			continue
		}
		lport := local[i+1:]
		rules = append(rules,
			[]string{"OUTPUT", "-p", "tcp", "--sport", lport, "-d", ip, "--dport", port, "-j", "DROP"},
			[]string{"INPUT", "-p", "tcp", "-s", ip, "--sport", port, "--dport", lport, "-j", "DROP"})
	}
	if len(rules) == 0 {
		return nil, fmt.Errorf("no established API connection of %s on %s:\n%s", who, n.Name, out)
	}
	return n.insertFilterRules(ctx, rules)
}

// insertFilterRules inserts DROP rules in the filter table (nf_tables
// backend, which coexists with either kube-proxy backend) and returns their
// removal.
func (n *Node) insertFilterRules(ctx context.Context, rules [][]string) (Undo, error) {
	var done [][]string
	undo := func(ctx context.Context) error {
		var errs []error
		for _, r := range done {
			if _, err := n.Exec(ctx, append([]string{"iptables", "-w", "5", "-D"}, r...)...); err != nil {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	}
	for _, r := range rules {
		if _, err := n.Exec(ctx, append([]string{"iptables", "-w", "5", "-I"}, r...)...); err != nil {
			_ = undo(ctx)
			return nil, err
		}
		done = append(done, r)
	}
	return undo, nil
}

// Freeze stops kube-proxy with SIGSTOP; the Undo thaws it with SIGCONT.
func (n *Node) Freeze(ctx context.Context) (Undo, error) {
	pid := n.ProxyPID()
	if n.real != nil {
		pid = n.podProxyPID()
	}
	if pid == 0 {
		return nil, fmt.Errorf("kube-proxy is not running on %s", n.Name)
	}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		return nil, fmt.Errorf("freeze kube-proxy on %s: %w", n.Name, err)
	}
	// Signal delivery is asynchronous: return once the process is stopped.
	if err := n.c.waitProcess(ctx, nil, 10*time.Second, "kube-proxy stopped on "+n.Name, func() bool { return procState(pid) == 'T' }); err != nil {
		_ = syscall.Kill(pid, syscall.SIGCONT)
		return nil, err
	}
	return func(context.Context) error {
		if procState(pid) == 'T' {
			return syscall.Kill(pid, syscall.SIGCONT)
		}
		return nil // restarted meanwhile: nothing left to thaw
	}, nil
}

// podProxyPID is the pid of the kube-proxy (or Cilium agent) running in a pod on a real
// node: the kube-proxy process in the node's network namespace (its pod
// has hostNetwork), or 0.
func (n *Node) podProxyPID() int {
	name := "kube-proxy"
	if n.Mode == ModeCilium {
		name = "cilium-agent"
	}
	want, err := os.Stat("/run/netns/" + n.NetNS)
	if err != nil {
		return 0
	}
	procs, _ := filepath.Glob("/proc/[0-9]*/comm")
	for _, comm := range procs {
		b, err := os.ReadFile(comm)
		if err != nil || strings.TrimSpace(string(b)) != name {
			continue
		}
		dir := filepath.Dir(comm)
		if st, err := os.Stat(filepath.Join(dir, "ns", "net")); err == nil && os.SameFile(st, want) && procState(atoi(filepath.Base(dir))) != 'Z' {
			return atoi(filepath.Base(dir))
		}
	}
	return 0
}

func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}

// FlushRules removes the node's kube-proxy NAT rules the way an operator's
// `iptables -t nat -F` (or `nft flush table ip kube-proxy`) does. A live
// kube-proxy restores them on a later sync; there is nothing to undo.
func (n *Node) FlushRules(ctx context.Context) error {
	if n.Mode == ModeNFTables {
		_, err := n.Exec(ctx, "nft", "flush", "table", "ip", "kube-proxy")
		return err
	}
	_, err := n.Exec(ctx, n.iptables(""), "-w", "5", "-t", "nat", "-F")
	return err
}

// TamperEndpoint rewrites the DNAT of one endpoint rule from `from` to `to`
// (both "ip:port"), as a hand edit or corruption would, leaving every other
// rule alone. kube-proxy repairs it only when it next rewrites that service.
func (n *Node) TamperEndpoint(ctx context.Context, from, to string) error {
	if n.Mode == ModeNFTables {
		return n.tamperNFT(ctx, from, to)
	}
	save, err := n.Exec(ctx, n.iptables("-save"), "-t", "nat")
	if err != nil {
		return err
	}
	var chain string
	for _, line := range strings.Split(save, "\n") {
		if strings.HasPrefix(line, "-A KUBE-SEP-") && strings.Contains(line, "--to-destination "+from) {
			chain = strings.Fields(line)[1]
			break
		}
	}
	if chain == "" {
		return fmt.Errorf("no KUBE-SEP rule DNATs to %s on %s", from, n.Name)
	}
	// Rewrite that one chain: declaring it in a --noflush restore replaces
	// its rules and touches nothing else.
	var b strings.Builder
	b.WriteString("*nat\n:" + chain + " - [0:0]\n")
	for _, line := range strings.Split(save, "\n") {
		if strings.HasPrefix(line, "-A "+chain+" ") {
			b.WriteString(strings.ReplaceAll(line, "--to-destination "+from, "--to-destination "+to) + "\n")
		}
	}
	b.WriteString("COMMIT\n")
	return n.restore(ctx, b.String())
}

func (n *Node) restore(ctx context.Context, input string) error {
	argv := []string{"sh", "-c", `printf '%s' "$1" | ` + n.iptables("-restore") + ` -w 5 --noflush`, "sh", input}
	_, err := n.Exec(ctx, argv...)
	return err
}

// tamperNFT replaces the rule in kube-proxy's table that DNATs to `from`,
// editing the listed rule's JSON and submitting it with `nft -j -f -` (chain
// names such as service-X-ns/name/tcp/p cannot be written in nft syntax).
func (n *Node) tamperNFT(ctx context.Context, from, to string) error {
	out, err := n.Exec(ctx, "nft", "-j", "-a", "list", "table", "ip", "kube-proxy")
	if err != nil {
		return err
	}
	var doc struct {
		Nftables []map[string]json.RawMessage `json:"nftables"`
	}
	if err := json.Unmarshal([]byte(out), &doc); err != nil {
		return fmt.Errorf("parse nft JSON: %w", err)
	}
	host, port, _ := strings.Cut(from, ":")
	toHost, toPort, _ := strings.Cut(to, ":")
	// The two shapes kube-proxy writes: a numgen map of [ip, port] pairs, or
	// an endpoint chain's {"addr": ip, "port": port}.
	replacer := strings.NewReplacer(
		`["`+host+`", `+port+`]`, `["`+toHost+`", `+toPort+`]`,
		`"addr": "`+host+`", "port": `+port, `"addr": "`+toHost+`", "port": `+toPort,
	)
	for _, obj := range doc.Nftables {
		raw, ok := obj["rule"]
		if !ok || !strings.Contains(string(raw), `"dnat"`) {
			continue
		}
		edited := replacer.Replace(string(raw))
		if edited == string(raw) {
			continue
		}
		cmd := `{"nftables": [{"replace": {"rule": ` + edited + `}}]}`
		_, err := n.Exec(ctx, "sh", "-c", `printf '%s' "$1" | nft -j -f -`, "sh", cmd)
		return err
	}
	return fmt.Errorf("no nftables rule DNATs to %s on %s", from, n.Name)
}

// PauseEtcd stops etcd with SIGSTOP, as a stalled disk or a long pause
// would: the API server's requests hang, its watches go quiet. Undo
// continues it.
func (c *Cluster) PauseEtcd() (Undo, error) {
	pid := c.etcd.cmd.Process.Pid
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		return nil, fmt.Errorf("pause etcd: %w", err)
	}
	return func(context.Context) error { return syscall.Kill(pid, syscall.SIGCONT) }, nil
}

// StopAPIServer stops kube-apiserver: every client's connection is
// refused until Undo starts it again (same certificates, same etcd) and it
// is ready.
func (c *Cluster) StopAPIServer() (Undo, error) {
	c.apiserver.stop(10 * time.Second)
	return func(ctx context.Context) error { return c.startAPIServer(ctx) }, nil
}

// Partition drops the node's TCP traffic with the given addresses and
// port, both ways: a partition between the node and those peers (the
// aggregator replicas, say) that leaves the node's API traffic alone.
func (n *Node) Partition(ctx context.Context, port int, ips ...string) (Undo, error) {
	p := strconv.Itoa(port)
	var rules [][]string
	for _, ip := range ips {
		rules = append(rules,
			[]string{"OUTPUT", "-d", ip, "-p", "tcp", "--dport", p, "-j", "DROP"},
			[]string{"INPUT", "-s", ip, "-p", "tcp", "--sport", p, "-j", "DROP"})
	}
	return n.insertFilterRules(ctx, rules)
}

// WithoutImage removes image ref from a real node's containerd: a pod
// started from it now (a restarted kube-proxy) cannot pull it (nothing is
// pulled here, as a node cut off from its registry) and waits in
// ImagePullBackOff, while containers already running from it go on. A
// restart does not cure the node. The Undo imports the node's images again.
func (n *Node) WithoutImage(ctx context.Context, ref string) (Undo, error) {
	if n.real == nil {
		return nil, fmt.Errorf("node %s is not a real node", n.Name)
	}
	if out, err := run(ctx, "ctr", "-a", n.real.socket, "-n", "k8s.io", "images", "rm", ref); err != nil {
		return nil, fmt.Errorf("remove %s on %s: %w\n%s", ref, n.Name, err, out)
	}
	return func(ctx context.Context) error {
		for _, img := range n.c.images {
			if out, err := run(ctx, "ctr", "-a", n.real.socket, "-n", "k8s.io", "images", "import", "--no-unpack", img); err != nil {
				return fmt.Errorf("import %s on %s: %w\n%s", img, n.Name, err, out)
			}
		}
		return nil
	}, nil
}
