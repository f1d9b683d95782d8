// What the view keeps of the API's objects (Trim) and how it files them
// by service (ServiceOf).

package view

import (
	"net/netip"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/client-go/tools/cache"

	"github.com/proxyaudit/proxyaudit/remediate"
)

// Trim drops what the audit never reads before an object enters the
// informer cache: managed fields, annotations, owner references, endpoint
// target references, most of Node status. At 100k endpoints this is the
// difference the benchmarks in docs/benchmarks.md record.
func Trim(obj any) (any, error) {
	if m, err := meta.Accessor(obj); err == nil {
		m.SetManagedFields(nil)
		m.SetOwnerReferences(nil)
		// No annotation is read from the cache (remediation keeps its record
		// in a ConfigMap and reads a Node afresh before acting on it).
		m.SetAnnotations(nil)
	}
	switch o := obj.(type) {
	case *discoveryv1.EndpointSlice:
		for i := range o.Endpoints {
			o.Endpoints[i].TargetRef = nil
			o.Endpoints[i].DeprecatedTopology = nil
			o.Endpoints[i].Hostname = nil
		}
	case *corev1.Node:
		var ready []corev1.NodeCondition
		for _, c := range o.Status.Conditions {
			if c.Type == corev1.NodeReady || c.Type == remediate.ConditionType {
				ready = append(ready, corev1.NodeCondition{Type: c.Type, Status: c.Status, Reason: c.Reason})
			}
		}
		//lint:ignore SA1019 kept for the known-bad kube-proxy releases (audit/knownbad.go)
		o.Status = corev1.NodeStatus{Conditions: ready, Addresses: o.Status.Addresses, NodeInfo: corev1.NodeSystemInfo{KubeProxyVersion: o.Status.NodeInfo.KubeProxyVersion}}
		o.Spec.PodCIDR, o.Spec.PodCIDRs = "", nil
	}
	return obj, nil
}

// byService indexes EndpointSlices by the namespace/name of their service.
const byService = "service"

// ServiceOf is the namespace/name an EndpointSlice or Service (or an
// informer's tombstone of one) belongs to; "" for anything else.
func ServiceOf(obj any) string {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	switch o := obj.(type) {
	case *corev1.Service:
		return o.Namespace + "/" + o.Name
	case *discoveryv1.EndpointSlice:
		if name := o.Labels[discoveryv1.LabelServiceName]; name != "" {
			return o.Namespace + "/" + name
		}
	}
	return ""
}

// IsNodeAddress says whether ip is an address of a Node of the cluster
// (collectors run on the host's network: their streams come from one).
func (v *View) IsNodeAddress(ip string) bool {
	if v == nil || v.nodeIdx == nil {
		return false
	}
	a, err := netip.ParseAddr(ip)
	if err != nil {
		return false
	}
	objs, _ := v.nodeIdx.ByIndex(byAddress, a.Unmap().String())
	return len(objs) > 0
}

// Node returns the cluster's Node object from the informer (nil if absent).
func (v *View) Node(name string) *corev1.Node {
	n, err := v.nodes.Get(name)
	if err != nil {
		return nil
	}
	return n
}

// EndpointSlices returns the informer's EndpointSlices of the Service
// namespace/name (the replicas' own, for their addresses).
func (v *View) EndpointSlices(service string) []*discoveryv1.EndpointSlice {
	objs, _ := v.sliceIdx.ByIndex(byService, service)
	out := make([]*discoveryv1.EndpointSlice, 0, len(objs))
	for _, o := range objs {
		out = append(out, o.(*discoveryv1.EndpointSlice))
	}
	return out
}
