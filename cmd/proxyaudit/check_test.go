package main

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// The check pod mounts Cilium's BPF filesystem from where the agent pins
// it: the default is made where missing (a node without Cilium reads
// none), a root named with --bpf-root must exist.
func TestCheckPodMountsTheBPFRoot(t *testing.T) {
	for _, tc := range []struct {
		root string
		typ  corev1.HostPathType
	}{
		{defaultBPFRoot, corev1.HostPathDirectoryOrCreate},
		{"/run/cilium/bpffs", corev1.HostPathDirectory},
	} {
		p := checkPod("check", "node-1", &checkOpts{image: "img", mode: "auto", bpfRoot: tc.root, timeout: time.Minute})
		var hp *corev1.HostPathVolumeSource
		for _, v := range p.Spec.Volumes {
			if v.Name == "bpffs" {
				hp = v.HostPath
			}
		}
		if hp == nil || hp.Path != tc.root || hp.Type == nil || *hp.Type != tc.typ {
			t.Errorf("--bpf-root %s: the pod's bpffs volume is %+v", tc.root, hp)
		}
		if c := p.Spec.Containers[0]; c.VolumeMounts[1].Name != "bpffs" || c.VolumeMounts[1].MountPath != "/sys/fs/bpf" || !c.VolumeMounts[1].ReadOnly {
			t.Errorf("--bpf-root %s: mounted as %+v", tc.root, c.VolumeMounts[1])
		}
	}
}
