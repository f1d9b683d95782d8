package audit_test

import (
	"bytes"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

var t0 = time.Date(2026, 11, 21, 12, 0, 0, 0, time.UTC)

type cluster struct {
	svcs   []corev1.Service
	slices []discoveryv1.EndpointSlice
}

func (c cluster) state() *audit.State { return audit.FromAPI(c.svcs, c.slices, nil) }

func synthCluster(spec synth.Spec) cluster {
	s, sl := spec.Objects()
	return cluster{s, sl}
}

// rulesOf is what a healthy kube-proxy programs for spec.
func rulesOf(t *testing.T, spec synth.Spec, edit func(string) string) *audit.Observed {
	t.Helper()
	var b bytes.Buffer
	if err := spec.WriteIPTablesSave(&b); err != nil {
		t.Fatal(err)
	}
	text := b.String()
	if edit != nil {
		text = edit(text)
	}
	obs, err := dataplane.ParseRules(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	return obs
}

// dropEndpoint returns c with the last endpoint of service i removed.
func dropEndpoint(c cluster, i int) cluster {
	out := cluster{svcs: c.svcs, slices: make([]discoveryv1.EndpointSlice, len(c.slices))}
	copy(out.slices, c.slices)
	eps := out.slices[i].Endpoints
	out.slices[i].Endpoints = eps[: len(eps)-1 : len(eps)-1]
	return out
}
