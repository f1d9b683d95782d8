package effect

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/proxyaudit/proxyaudit/remediate"
)

// The pause request as the aggregator reads it: none without the
// ConfigMap or with it empty (as the chart makes it); who, since and why
// while it holds; nothing once its --for has passed; and a request that
// cannot be read or understood holds repairs too, saying so.
func TestPauseHeld(t *testing.T) {
	ctx := context.Background()
	clk := clocktesting.NewFakePassiveClock(t0)
	cm := func(data map[string]string) *corev1.ConfigMap {
		return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "proxyaudit", Name: "p"}, Data: data}
	}
	pause := remediate.PauseRequest{By: "alice@example.com", Reason: "kube-proxy rollout", Since: t0.Add(-time.Minute), Until: t0.Add(time.Hour)}
	for _, tc := range []struct {
		name string
		objs []runtime.Object
		deny bool
		now  time.Time
		want string
	}{
		{"no ConfigMap", nil, false, t0, ""},
		{"empty, as the chart makes it", []runtime.Object{cm(nil)}, false, t0, ""},
		{"paused", []runtime.Object{cm(pause.Data())}, false, t0, "by alice@example.com since 2026-11-21T11:59:00Z until 2026-11-21T13:00:00Z: kube-proxy rollout"},
		{"the pause has ended", []runtime.Object{cm(pause.Data())}, false, t0.Add(2 * time.Hour), ""},
		{"malformed", []runtime.Object{cm(map[string]string{"since": "yesterday"})}, false, t0, "is malformed, so repairs are held"},
		{"cannot be read", nil, true, t0, "cannot be read, so repairs are held"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client := fake.NewClientset(tc.objs...)
			if tc.deny {
				client.PrependReactor("get", "configmaps", func(k8stesting.Action) (bool, runtime.Object, error) {
					return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "configmaps"}, "p", errors.New("RBAC"))
				})
			}
			clk.SetTime(tc.now)
			p := &Pause{Client: client, Namespace: "proxyaudit", Name: "p", MaxAge: time.Second, Clock: clk}
			got := p.Held(ctx)
			if (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) {
				t.Errorf("held %q, want %q", got, tc.want)
			}
		})
	}
	// A copy younger than MaxAge serves; then the ConfigMap is read again.
	client := fake.NewClientset(cm(pause.Data()))
	clk.SetTime(t0)
	p := &Pause{Client: client, Namespace: "proxyaudit", Name: "p", MaxAge: 5 * time.Second, Clock: clk}
	if p.Held(ctx) == "" {
		t.Fatal("not paused")
	}
	if err := client.CoreV1().ConfigMaps("proxyaudit").Delete(ctx, "p", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if p.Held(ctx) == "" {
		t.Error("the copy in hand was not used")
	}
	clk.SetTime(t0.Add(6 * time.Second))
	if got := p.Held(ctx); got != "" {
		t.Errorf("resumed, yet held %q", got)
	}
}
