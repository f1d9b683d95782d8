package localcluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"

	"golang.org/x/sys/unix"
)

// Scratch is a bare network namespace, without a cluster, for loading a
// ruleset into the real kernel and timing the tools that read it back. It
// holds the machine-wide lock, so it never races a cluster's cleanup.
type Scratch struct {
	NetNS   string
	release func()
}

// NewScratch creates the namespace pa-x-<name>.
func NewScratch(ctx context.Context, name string) (*Scratch, error) {
	if err := CanRun(); err != nil {
		return nil, err
	}
	release, err := takeLock(ctx, nil)
	if err != nil {
		return nil, err
	}
	s := &Scratch{NetNS: namePrefix + "x-" + name, release: release}
	_, _ = run(ctx, "ip", "netns", "del", s.NetNS)
	if _, err := run(ctx, "ip", "netns", "add", s.NetNS); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// Command returns argv to run inside the namespace.
func (s *Scratch) Command(ctx context.Context, argv ...string) *exec.Cmd {
	return exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", s.NetNS}, argv...)...)
}

// Exec runs argv inside the namespace and returns its combined output.
func (s *Scratch) Exec(ctx context.Context, argv ...string) (string, error) {
	return run(ctx, append([]string{"ip", "netns", "exec", s.NetNS}, argv...)...)
}

// Close deletes the namespace (and with it every rule loaded there) and
// releases the lock.
func (s *Scratch) Close() error {
	var err error
	if s.NetNS != "" {
		if _, e := run(context.Background(), "ip", "netns", "del", s.NetNS); e != nil {
			err = e
		}
	}
	if s.release != nil {
		s.release()
		s.release = nil
	}
	return err
}

// InNetNS runs f on an OS thread switched into the named network namespace
// (a node's NetNS or a Scratch's); processes f starts inherit it. It lets a
// test call the collector's code as if it ran on that node.
func InNetNS(name string, f func() error) error {
	runtime.LockOSThread()
	orig, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer orig.Close()
	target, err := os.Open("/run/netns/" + name)
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter netns %s: %w", name, err)
	}
	ferr := f()
	if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
		// The thread stays locked: Go ends it with the goroutine rather
		// than reuse it in the wrong namespace.
		return errors.Join(ferr, fmt.Errorf("return from netns %s: %w", name, err))
	}
	runtime.UnlockOSThread()
	return ferr
}
