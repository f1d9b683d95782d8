package localcluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// markerEnv is set in the environment of every process the harness starts,
// to its owner: the starting process's PID and start time (marker). Scanning
// /proc for it finds our processes even after the harness itself was killed,
// so a later run can clean up and tests can prove nothing is left; the owner
// keeps the scan off what another live test process started (an
// Alertmanager of the aggregator's unit tests, which take no cluster lock,
// was SIGKILLed by a cluster starting in another package).
const markerEnv = "PROXYAUDIT_LOCALCLUSTER"

// marker is this process's owner value, "PID:START" (START in clock ticks
// since boot, /proc/PID/stat's 22nd field: a reused PID has another).
var marker = fmt.Sprintf("%d:%d", os.Getpid(), startTicks(os.Getpid()))

// startTicks is when pid started, in clock ticks since boot; 0 when it
// does not exist.
func startTicks(pid int) uint64 {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0
	}
	// Fields after the command: state is the 3rd field, starttime the 22nd.
	f := strings.Fields(string(stat[i+1:]))
	if len(f) < 20 {
		return 0
	}
	t, _ := strconv.ParseUint(f[19], 10, 64)
	return t
}

// ours says whether a marked process with this owner value is this
// process's to clean: started by this process, or by one that is gone (a
// crashed run; an unreadable or older value counts as gone). A live other
// process's are its own: it stops them, and the kernel kills them with it.
func ours(owner string) bool {
	if owner == marker {
		return true
	}
	pidText, ticksText, ok := strings.Cut(owner, ":")
	pid, err1 := strconv.Atoi(pidText)
	ticks, err2 := strconv.ParseUint(ticksText, 10, 64)
	if !ok || err1 != nil || err2 != nil || pid <= 0 {
		return true
	}
	return startTicks(pid) != ticks
}

// process is one long-running child (etcd, kube-apiserver, kube-proxy).
type process struct {
	name string
	cmd  *exec.Cmd
	log  *os.File
	done chan struct{}
	err  error
}

// startProcess starts argv with its output in logPath. The child gets
// SIGKILL if the harness dies (Pdeathsig) and carries the marker variable
// (and env, VAR=value, beside the harness's own environment).
func startProcess(name, logPath string, argv []string, env ...string) (*process, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(append(os.Environ(), env...), markerEnv+"="+marker)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &process{name: name, cmd: cmd, log: logf, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	return p, nil
}

// exited reports whether the process has ended.
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM, waits up to grace, then SIGKILLs. A stopped (SIGSTOP)
// process is continued first so that it can act on SIGTERM.
func (p *process) stop(grace time.Duration) {
	if p == nil || p.exited() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGCONT)
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// run runs a short command and returns its combined output; the error names
// the command and includes what it printed.
func run(ctx context.Context, argv ...string) (string, error) {
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("%s: %w: %s", strings.Join(argv, " "), err, strings.TrimSpace(out.String()))
	}
	return out.String(), nil
}

// markedPIDs lists the processes that carry the harness marker variable
// and are this process's to clean (see ours).
func markedPIDs() []int {
	entries, _ := os.ReadDir("/proc")
	var pids []int
	self := os.Getpid()
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		env, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if err != nil {
			continue
		}
		for _, kv := range bytes.Split(env, []byte{0}) {
			if owner, ok := bytes.CutPrefix(kv, []byte(markerEnv+"=")); ok {
				if ours(string(owner)) {
					pids = append(pids, pid)
				}
				break
			}
		}
	}
	return pids
}

// pidAlive reports whether pid still exists and is not a zombie.
func pidAlive(pid int) bool {
	st := procState(pid)
	return st != 0 && st != 'Z'
}

// procState returns the one-letter state of pid (R, S, T, Z, …), or 0.
func procState(pid int) byte {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 || i+2 >= len(stat) {
		return 0
	}
	return stat[i+2]
}

// killMarked SIGKILLs every marked process and waits for them to go.
func killMarked() error {
	pids := markedPIDs()
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGCONT)
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, pid := range pids {
		for pidAlive(pid) {
			if time.Now().After(deadline) {
				return errors.New("leftover processes did not exit after SIGKILL: " + fmt.Sprint(pids))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return nil
}

// Process is a long-running program the harness started for a test (a
// collector in a node's namespace, an aggregator on the host). It is
// killed with the cluster and found by the leftover scan like the rest.
type Process struct {
	p *process
	// Log is the file holding its output.
	Log string
}

// StartProcess runs argv on the host as part of the cluster, its output in
// Dir/NAME.log.
func (c *Cluster) StartProcess(name string, argv ...string) (*Process, error) {
	log := filepath.Join(c.Dir, name+".log")
	p, err := startProcess(name, log, argv)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.extra = append(c.extra, p)
	c.mu.Unlock()
	return &Process{p: p, Log: log}, nil
}

// StartProcess runs argv inside the node's network namespace.
func (n *Node) StartProcess(name string, argv ...string) (*Process, error) {
	return n.c.StartProcess(name, append([]string{"ip", "netns", "exec", n.NetNS}, argv...)...)
}

// Stop ends the process (SIGTERM, SIGKILL after 5 s).
func (p *Process) Stop() { p.p.stop(5 * time.Second) }

// Kill ends the process with SIGKILL, as a crash or an OOM kill would.
func (p *Process) Kill() {
	if !p.p.exited() {
		_ = p.p.cmd.Process.Kill()
		<-p.p.done
	}
}

// Exited reports whether the process has ended.
func (p *Process) Exited() bool { return p.p.exited() }

// Tail returns the last n lines of its log.
func (p *Process) Tail(n int) string { return tailFile(p.Log, n) }

// PID is the process's ID (of `ip netns exec` for a node's process, which
// execs the program: the same process).
func (p *Process) PID() int { return p.p.cmd.Process.Pid }

// ProcStat is a process's resource use as the kernel counts it.
type ProcStat struct {
	RSS, PeakRSS int64         // bytes
	CPU          time.Duration // user + system
	// ChildCPU is the user + system time of the children it waited for:
	// kube-proxy's iptables-restore and nft, the collector's
	// iptables-save. Its own cost includes them.
	ChildCPU time.Duration
}

// ReadProcStat reads pid's /proc status and stat.
func ReadProcStat(pid int) (ProcStat, error) {
	var ps ProcStat
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return ps, err
	}
	for _, line := range strings.Split(string(status), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok || (k != "VmRSS" && k != "VmHWM") {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		if err != nil {
			return ps, fmt.Errorf("%s: %q: %w", k, v, err)
		}
		if k == "VmRSS" {
			ps.RSS = kb << 10
		} else {
			ps.PeakRSS = kb << 10
		}
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ps, err
	}
	// Fields after the command name (which may hold spaces) in parentheses.
	s := string(stat)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 15 {
		return ps, fmt.Errorf("short /proc/%d/stat", pid)
	}
	ticks := func(i int) time.Duration {
		n, _ := strconv.ParseInt(f[i], 10, 64)
		return time.Duration(n) * time.Second / 100 // USER_HZ is 100 on Linux
	}
	ps.CPU, ps.ChildCPU = ticks(11)+ticks(12), ticks(13)+ticks(14)
	return ps, nil
}
