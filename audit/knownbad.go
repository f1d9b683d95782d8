package audit

import (
	"fmt"
	"strings"
)

// knownBad are kube-proxy releases whose IPVS graceful termination could
// hang, retrying forever to delete old real servers (kubernetes#71071,
// fixed by #72361): [minor, first patch, last patch] of 1.x.
var knownBad = [][3]int{{11, 5, 6}, {12, 2, 4}, {13, 0, 1}}

// WarnKnownBad adds a warning to every IPVS node of the verdict whose
// kube-proxy release is in the known-bad window. The version comes from
// kube-proxy's own metrics when they carry it (kubernetes_build_info),
// else from the Node's status.nodeInfo.kubeProxyVersion.
func WarnKnownBad(v *Verdict, nodes map[string]NodeInfo) {
	for i := range v.Nodes {
		n := &v.Nodes[i]
		if n.Mode != ModeIPVS {
			continue
		}
		version := nodes[n.Node].KubeProxyVersion
		if n.KubeProxy != nil && n.KubeProxy.Version != "" {
			version = n.KubeProxy.Version
		}
		if w := KnownBadKubeProxy(version); w != "" {
			n.Warnings = append(n.Warnings, w)
		}
	}
}

// KnownBadKubeProxy returns why a kube-proxy version is unsafe in IPVS
// mode, or "" ("v1.12.3", "v1.12.3-gke.1" and "1.12.3+k3s1" all parse).
func KnownBadKubeProxy(version string) string {
	v := strings.TrimPrefix(version, "v")
	if i := strings.IndexAny(v, "-+"); i >= 0 {
		v = v[:i]
	}
	var major, minor, patch int
	if n, _ := fmt.Sscanf(v, "%d.%d.%d", &major, &minor, &patch); n != 3 || major != 1 {
		return ""
	}
	for _, b := range knownBad {
		if minor == b[0] && patch >= b[1] && patch <= b[2] {
			return fmt.Sprintf("kube-proxy %s is in the known-bad window 1.11.5–1.11.6, 1.12.2–1.12.4, 1.13.0–1.13.1: its IPVS graceful termination can hang and keep old real servers for days (kubernetes#71071); upgrade kube-proxy", version)
		}
	}
	return ""
}
