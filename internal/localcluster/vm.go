package localcluster

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// VM addresses: QEMU's user-mode network inside 198.18.64.0/24. The guest
// reaches every host address (the API server on 198.18.0.1, aggregator
// replicas) through the gateway, which QEMU turns into host sockets.
const (
	VMGuestIP = "198.18.64.15"
	vmNet     = "198.18.64.0/24"
	// VMGuestIP6 is the guest's IPv6 InternalIP in a dual-stack cluster:
	// kube-proxy needs a node address per family to program that
	// family's node ports.
	VMGuestIP6 = "2001:2:0:40::15"
)

// VMNode is a node running in a QEMU virtual machine with a real Linux
// kernel, for the proxy mode the host kernel cannot run (IPVS). The guest's
// userland is the host's filesystem, read-only over 9p (deploy/vm/init):
// kube-proxy, iptables, ipset, ipvsadm and the binaries the tests build
// run unchanged. Dir is shared read-write under the same path in the
// guest; guest processes write their logs there.
type VMNode struct {
	Name string
	IP   string
	Dir  string
	// Boot is how long the kernel took to reach the console.
	Boot time.Duration

	c       *Cluster
	qemu    *process
	console io.WriteCloser
	lines   chan string
	mu      sync.Mutex // one command on the console at a time
	seq     int
}

// EnsureVMImage builds (or reuses) the VM's kernel and initramfs with
// deploy/vm/build.sh and returns their directory.
func EnsureVMImage(ctx context.Context) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	script := filepath.Join(root, "deploy", "vm", "build.sh")
	cmd := exec.CommandContext(ctx, script)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("build the VM image (%s): %w\n%s", script, err, tail(stderr.String(), 20))
	}
	return strings.TrimSpace(stdout.String()), nil
}

// CanRunVM says why the IPVS VM cannot run here, or nil.
func CanRunVM() error {
	for _, tool := range []string{"qemu-system-x86_64", "busybox", "ipset", "ipvsadm"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s not found (deploy/install-deps.sh installs it)", tool)
		}
	}
	return nil
}

// AddVMNode boots a VM, registers it as a Node (InternalIP VMGuestIP,
// spec's name and zone) and, unless spec.NoProxy, starts kube-proxy in
// IPVS mode in it, returning once kube-proxy has programmed
// default/kubernetes. Only one VM runs at a time (its address is fixed);
// Stop (or the cluster's Stop) ends it.
func (c *Cluster) AddVMNode(ctx context.Context, spec NodeSpec) (*VMNode, error) {
	name, zone := spec.Name, spec.Zone
	if c.cfg.Instance != 0 {
		return nil, fmt.Errorf("node %s: VM nodes run only in the first local cluster instance", name)
	}
	v, err := BootVM(ctx, name, filepath.Join(c.Dir, "vm-"+name), c.logf)
	if err != nil {
		return nil, err
	}
	v.c = c
	c.mu.Lock()
	c.extra = append(c.extra, v.qemu)
	c.mu.Unlock()
	n := &Node{Name: name, Zone: zone, IP: v.IP}
	if c.cfg.DualStack {
		n.IP6 = VMGuestIP6
		if _, err := v.Run(ctx, "ip addr add "+VMGuestIP6+"/64 dev eth0 nodad"); err != nil {
			v.Stop()
			return nil, err
		}
	}
	if err := c.registerNode(ctx, n); err != nil {
		v.Stop()
		return nil, err
	}
	if spec.NoProxy {
		return v, nil
	}
	if err := v.StartProxy(ctx); err != nil {
		v.Stop()
		return nil, err
	}
	return v, nil
}

// BootVM boots the VM with dir as its shared work directory and returns
// once its console answers and its kernel has IPVS. It needs no cluster
// (benchmarks run in it); AddVMNode makes it a node.
func BootVM(ctx context.Context, name, dir string, logf func(string, ...any)) (*VMNode, error) {
	img, err := EnsureVMImage(ctx)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	// Emulated (TCG) boots take ~9 s on an idle machine and ~25 s beside
	// four busy cores, but a CI run once saw no console at all for 3
	// minutes while cold builds ran beside it. A boot that stalls is
	// retried once with a fresh QEMU; both consoles' tails go in the error.
	var errs []string
	for attempt := 1; attempt <= 2; attempt++ {
		v, err := bootVM(ctx, name, dir, img)
		if err == nil {
			if logf != nil {
				logf("VM %s booted in %s (attempt %d)", name, v.Boot.Round(time.Millisecond), attempt)
			}
			if _, err := v.Run(ctx, "grep -q 'IP Virtual Server' /proc/net/ip_vs"); err != nil {
				v.Stop()
				return nil, fmt.Errorf("VM %s has no IPVS: %w", name, err)
			}
			return v, nil
		}
		if ctx.Err() != nil {
			return nil, err
		}
		errs = append(errs, fmt.Sprintf("attempt %d: %v; the console's last lines:\n%s", attempt, err, tailFile(dir+".console.log", 15)))
		if logf != nil {
			logf("VM %s: boot attempt %d failed: %v", name, attempt, err)
		}
	}
	return nil, fmt.Errorf("boot VM %s:\n%s", name, strings.Join(errs, "\n"))
}

// bootVM starts one QEMU and waits for the guest's ready line.
func bootVM(ctx context.Context, name, dir, img string) (*VMNode, error) {
	v := &VMNode{Name: name, IP: VMGuestIP, Dir: dir, lines: make(chan string, 4096)}
	// loglevel=4: the kernel's warnings reach the console while it boots
	// (a stalled boot says where); the guest's init lowers it before the
	// console carries commands.
	argv := []string{"qemu-system-x86_64", "-accel", "tcg", "-cpu", "max", "-m", "1536", "-smp", "2",
		"-nographic", "-no-reboot", "-monitor", "none", "-serial", "stdio",
		"-kernel", filepath.Join(img, "vmlinuz"), "-initrd", filepath.Join(img, "initramfs.gz"),
		"-append", "console=ttyS0 loglevel=4 panic=-1 proxyaudit.work=" + v.Dir,
		"-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
		"-virtfs", "local,path=" + v.Dir + ",mount_tag=work,security_model=none",
		"-netdev", "user,id=n0,net=" + vmNet + ",host=" + VMHostIP, "-device", "virtio-net-pci,netdev=n0"}
	logFile, err := os.OpenFile(v.Dir+".console.log", os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), markerEnv+"="+marker)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	cmd.Stderr = logFile
	if v.console, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("start qemu: %w", err)
	}
	v.qemu = &process{name: "vm[" + name + "]", cmd: cmd, log: logFile, done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(io.TeeReader(out, logFile))
		sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
		for sc.Scan() {
			select {
			case v.lines <- strings.TrimRight(sc.Text(), "\r"):
			default: // nobody is reading: drop (the log keeps it)
			}
		}
		v.qemu.err = cmd.Wait()
		logFile.Close()
		close(v.qemu.done)
		close(v.lines)
	}()
	if err := v.expect(ctx, 3*time.Minute, regexp.MustCompile(`@@proxyaudit-vm-ready (.*)`), nil); err != nil {
		v.Stop()
		return nil, err
	}
	v.Boot = time.Since(start)
	return v, nil
}

// expect reads console lines until one matches re (appending every line
// read to *collect when set), the VM exits, or the timeout passes.
func (v *VMNode) expect(ctx context.Context, timeout time.Duration, re *regexp.Regexp, collect *[]string) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	for {
		select {
		case line, ok := <-v.lines:
			if !ok {
				return fmt.Errorf("qemu exited (%v); console log: %s", v.qemu.err, v.qemu.log.Name())
			}
			if strings.HasPrefix(line, "@@proxyaudit-vm-shell-exited") {
				return fmt.Errorf("the guest's console shell ended (%s) before answering: a new one runs; console log: %s", line, v.qemu.log.Name())
			}
			if re.MatchString(line) {
				if collect != nil {
					*collect = append(*collect, line)
				}
				return nil
			}
			if collect != nil {
				*collect = append(*collect, line)
			}
		case <-t.C:
			return fmt.Errorf("no %q on the console after %s; console log: %s", re, timeout, v.qemu.log.Name())
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Run runs a shell script in the guest, in the host's filesystem (chroot),
// and returns its combined output; a non-zero exit is an error carrying
// the output. Scripts run one at a time.
func (v *VMNode) Run(ctx context.Context, script string) (string, error) {
	return v.RunFor(ctx, 2*time.Minute, script)
}

// RunFor is Run with its own timeout, for long scripts (benchmarks).
func (v *VMNode) RunFor(ctx context.Context, timeout time.Duration, script string) (string, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.seq++
	marker := fmt.Sprintf("@@done-%d", v.seq)
	// The script travels quoted on one line; its output ends with the
	// marker and the exit status.
	line := fmt.Sprintf("chroot /host /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/ TMPDIR=%s /bin/sh -c %s </dev/null 2>&1; echo \"%s $?\"\n",
		shellQuote(v.Dir), shellQuote(script), marker)
	if _, err := io.WriteString(v.console, line); err != nil {
		return "", fmt.Errorf("VM console: %w", err)
	}
	var out []string
	re := regexp.MustCompile("^(.*)" + marker + ` (\d+)$`)
	if err := v.expect(ctx, timeout, re, &out); err != nil {
		return strings.Join(out, "\n"), fmt.Errorf("VM %s: %q: %w", v.Name, clipScript(script), err)
	}
	m := re.FindStringSubmatch(out[len(out)-1])
	out[len(out)-1] = m[1]
	if out[len(out)-1] == "" {
		out = out[:len(out)-1]
	}
	text := strings.Join(out, "\n")
	if rc, _ := strconv.Atoi(m[2]); rc != 0 {
		return text, fmt.Errorf("VM %s: %q exited %d: %s", v.Name, clipScript(script), rc, tail(text, 20))
	}
	return text, nil
}

// Start runs argv in the background in the guest, its output in
// Dir/NAME.log; StopProcess ends it.
func (v *VMNode) Start(ctx context.Context, name string, argv ...string) error {
	q := make([]string, len(argv))
	for i, a := range argv {
		q[i] = shellQuote(a)
	}
	log, pid := filepath.Join(v.Dir, name+".log"), filepath.Join(v.Dir, name+".pid")
	_, err := v.Run(ctx, fmt.Sprintf("%s >>%s 2>&1 & echo $! >%s", strings.Join(q, " "), shellQuote(log), shellQuote(pid)))
	return err
}

// StopProcess ends a process Start began (SIGTERM, then SIGKILL).
func (v *VMNode) StopProcess(ctx context.Context, name string) error {
	pid := filepath.Join(v.Dir, name+".pid")
	_, err := v.Run(ctx, fmt.Sprintf("p=$(cat %s) || exit 0; kill $p 2>/dev/null; for i in 1 2 3 4 5 6 7 8 9 10; do kill -0 $p 2>/dev/null || exit 0; sleep 0.5; done; kill -9 $p", shellQuote(pid)))
	return err
}

// Log returns the last n lines of a guest process's log.
func (v *VMNode) Log(name string, n int) string {
	return tailFile(filepath.Join(v.Dir, name+".log"), n)
}

// StartProxy starts the genuine kube-proxy in IPVS mode and waits until it
// has programmed default/kubernetes (a virtual server with the API server
// as its real server).
func (v *VMNode) StartProxy(ctx context.Context) error {
	if err := v.Start(ctx, "kube-proxy", v.c.kubeProxy(),
		"--kubeconfig="+v.c.proxyKubeconfig,
		"--proxy-mode=ipvs",
		"--hostname-override="+v.Name,
		"--conntrack-max-per-core=0",
		"--cluster-cidr="+v.c.podCIDRs(),
		"--healthz-bind-address=0.0.0.0:10256",
		"--metrics-bind-address=127.0.0.1:10249",
		"--v=2"); err != nil {
		return err
	}
	want := fmt.Sprintf("%s:%d", APIServerIP, APIServerPort)
	deadline := time.Now().Add(3 * time.Minute)
	for {
		out, err := v.Run(ctx, "ipvsadm -Sn")
		if err == nil && strings.Contains(out, want) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kube-proxy in VM %s programmed no virtual server for default/kubernetes in 3m; its log:\n%s", v.Name, v.Log("kube-proxy", 20))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(2 * time.Second):
		}
	}
}

// IPVS returns `ipvsadm -Sn` in the guest.
func (v *VMNode) IPVS(ctx context.Context) (string, error) { return v.Run(ctx, "ipvsadm -Sn") }

// HangInformer silently drops the guest's traffic to the API server, as
// a dead watch connection would: kube-proxy's health checks stay green and
// its IPVS rules stop following the cluster. Undo removes the rules.
//
// Both directions are dropped: QEMU's user-mode network terminates TCP in
// QEMU, which keeps sending the API server's data into the guest's
// window even when the guest's ACKs are dropped, so an OUTPUT rule alone
// lets watch events trickle through.
func (v *VMNode) HangInformer(ctx context.Context) (Undo, error) {
	out := fmt.Sprintf("OUTPUT -p tcp -d %s --dport %d -j DROP", APIServerIP, APIServerPort)
	in := fmt.Sprintf("INPUT -p tcp -s %s --sport %d -j DROP", APIServerIP, APIServerPort)
	if _, err := v.Run(ctx, "iptables -w -I "+in+" && iptables -w -I "+out); err != nil {
		return nil, err
	}
	return func(ctx context.Context) error {
		_, err := v.Run(ctx, "iptables -w -D "+out+"; iptables -w -D "+in)
		return err
	}, nil
}

// Stop powers the VM off (killing qemu if it does not stop in time). The
// Node object stays.
func (v *VMNode) Stop() {
	if v.qemu == nil || v.qemu.exited() {
		return
	}
	_, _ = io.WriteString(v.console, "poweroff -f\n")
	select {
	case <-v.qemu.done:
	case <-time.After(10 * time.Second):
		v.qemu.stop(time.Second)
	}
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

func clipScript(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
