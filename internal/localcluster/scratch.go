package localcluster

import (
	"context"
	"errors"
	"os"
	"os/exec"
)

// Scratch is a bare network namespace, without a cluster, for loading a
// ruleset into the real kernel and timing the tools that read it back. It
// holds the machine-wide lock, so it never races a cluster's cleanup.
type Scratch struct {
	NetNS string
	lock  *os.File
}

// NewScratch creates the namespace pa-x-<name>.
func NewScratch(ctx context.Context, name string) (*Scratch, error) {
	if err := CanRun(); err != nil {
		return nil, err
	}
	lock, err := takeLock(ctx, nil)
	if err != nil {
		return nil, err
	}
	s := &Scratch{NetNS: namePrefix + "x-" + name, lock: lock}
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
	if s.lock != nil {
		err = errors.Join(err, s.lock.Close())
		s.lock = nil
	}
	return err
}
