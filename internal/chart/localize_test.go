package chart

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// The memory limit the chart passes the aggregator by the downward API is
// what the kubelet would put there, for the local processes the live
// suite runs with the chart's environment.
func TestResourceFieldAsTheKubeletGivesIt(t *testing.T) {
	c := &corev1.Container{Name: "aggregator", Resources: corev1.ResourceRequirements{
		Limits: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")}}}
	for _, tc := range []struct {
		ref  corev1.ResourceFieldSelector
		want string
		err  string
	}{
		{ref: corev1.ResourceFieldSelector{Resource: "limits.memory"}, want: "1073741824"},
		{ref: corev1.ResourceFieldSelector{Resource: "limits.memory", Divisor: resource.MustParse("1Mi")}, want: "1024"},
		{ref: corev1.ResourceFieldSelector{Resource: "limits.memory", Divisor: resource.MustParse("1G")}, want: "2"}, // rounded up
		{ref: corev1.ResourceFieldSelector{Resource: "requests.memory"}, err: "not set"},
		{ref: corev1.ResourceFieldSelector{Resource: "limits.cpu"}, err: "only limits.memory"},
	} {
		got, err := resourceField(c, &tc.ref)
		if got != tc.want || (tc.err == "") != (err == nil) || err != nil && !strings.Contains(err.Error(), tc.err) {
			t.Errorf("%s / %s: %q, %v; want %q, %q", tc.ref.Resource, tc.ref.Divisor.String(), got, err, tc.want, tc.err)
		}
	}
}
