package localcluster

import (
	"strings"
	"testing"
)

// A process told it runs in lane N without deploy/lane.sh's namespaces
// would take lane N's lock while using lane 0's addresses and names: it is
// refused with what to do; and it is not lane 0, the only lane whose
// cleanup may touch real nodes' cgroups.
func TestLaneInNameOnlyIsRefused(t *testing.T) {
	t.Setenv(laneEnv, "")
	if err := checkLane(); err != nil || !machineLane() {
		t.Fatalf("lane 0: %v (machine lane %v)", err, machineLane())
	}
	t.Setenv(laneEnv, "7")
	err := checkLane()
	if err == nil || !strings.Contains(err.Error(), "deploy/lane.sh 7") {
		t.Fatalf("lane 7 outside its namespaces: %v", err)
	}
	if machineLane() {
		t.Error("lane 7 taken for the machine's lane: its cleanup would remove lane 0's real nodes")
	}
}
