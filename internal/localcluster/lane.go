package localcluster

import (
	"fmt"
	"os"
	"strings"
)

// laneEnv names the cluster lane a process runs in. Lane 0 (unset) is the
// machine's own namespaces; deploy/lane.sh runs a command in lane N ≥ 1,
// a network and mount namespace of its own (its own /run/netns and
// /run/lock), so its clusters run beside lane 0's instead of after them.
// Only lane 0 may run real kubelet nodes: their cgroups, mounts and the
// host's IPv4 forwarding are the machine's, not a lane's, and another
// lane's cleanup must never touch them.
const laneEnv = "PROXYAUDIT_LANE"

// lane is the lane this process runs in (0: the machine's own namespaces).
func lane() string {
	if v := os.Getenv(laneEnv); v != "" {
		return v
	}
	return "0"
}

func machineLane() bool { return lane() == "0" }

// checkLane refuses a lane that is one in name only: a process told it runs
// in lane N but without the lane's own /run/netns (deploy/lane.sh mounts a
// tmpfs named proxyaudit-laneN there) would take another lock than lane
// 0's clusters while using their addresses and names.
func checkLane() error {
	if machineLane() {
		return nil
	}
	info, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	for _, line := range strings.Split(string(info), "\n") {
		// … mount-point … - fstype source options
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if ok && len(f) > 4 && f[4] == "/run/netns" && len(g) > 1 && g[1] == "proxyaudit-lane"+lane() {
			return nil
		}
	}
	return fmt.Errorf("%s=%s, but /run/netns is not lane %s's own: run the command through deploy/lane.sh %s", laneEnv, lane(), lane(), lane())
}
