package localcluster

import (
	"fmt"
	"os"
	"os/exec"
	"slices"
	"syscall"
	"testing"
	"time"
)

// The leftover scan takes what this process started and what a gone
// process left, never what another live process started: a cluster
// starting (or stopping) in one test package SIGKILLed the Alertmanager
// another package's unit test had just started (CI, this session).
func TestLeftoverScanSparesOtherLiveOwners(t *testing.T) {
	start := func(owner string) *exec.Cmd {
		t.Helper()
		cmd := exec.Command("sleep", "60")
		if owner != "" {
			cmd.Env = append(os.Environ(), markerEnv+"="+owner)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		return cmd
	}
	other := start("") // another live test process
	otherOwner := fmt.Sprintf("%d:%d", other.Process.Pid, startTicks(other.Process.Pid))
	if startTicks(other.Process.Pid) == 0 {
		t.Fatal("no start time read for a live process")
	}
	mine := start(marker)
	theirs := start(otherOwner)
	crashed := start("999999999:1")                                                           // an owner that is gone
	legacy := start("1")                                                                      // an older harness's marker
	reused := start(fmt.Sprintf("%d:%d", other.Process.Pid, startTicks(other.Process.Pid)+1)) // the PID reused since

	pids := markedPIDs()
	for name, c := range map[string]*exec.Cmd{"this process's": mine, "a gone owner's": crashed, "an older harness's": legacy, "a reused PID's": reused} {
		if !slices.Contains(pids, c.Process.Pid) {
			t.Errorf("the scan misses %s process", name)
		}
	}
	if slices.Contains(pids, theirs.Process.Pid) {
		t.Fatal("the scan takes a live other process's")
	}
	// Its owner gone, the other's process is a leftover like any.
	_ = other.Process.Signal(syscall.SIGKILL)
	_ = other.Wait()
	deadline := time.Now().Add(5 * time.Second)
	for !slices.Contains(markedPIDs(), theirs.Process.Pid) {
		if time.Now().After(deadline) {
			t.Fatal("a gone owner's process is not taken")
		}
		time.Sleep(20 * time.Millisecond)
	}
}
