package realnodes

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/openreports"
)

// reportsWatch follows proxyaudit's ClusterReports through a watch, so a
// report that lives a few seconds (found, repaired, gone) is still seen.
type reportsWatch struct {
	mu     sync.Mutex
	events []string // "ADDED proxyaudit-node-x proxyaudit/StuckProxy,…"
	stop   func()
}

func watchReports(ctx context.Context, t *testing.T, c *localcluster.Cluster) *reportsWatch {
	t.Helper()
	dc, err := dynamic.NewForConfig(c.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	w, err := dc.Resource(openreports.Resource).Watch(ctx, metav1.ListOptions{LabelSelector: openreports.LabelManagedBy + "=" + openreports.Source})
	if err != nil {
		cancel()
		t.Fatalf("watch ClusterReports: %v", err)
	}
	rw := &reportsWatch{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ev := range w.ResultChan() {
			u, ok := ev.Object.(*unstructured.Unstructured)
			if !ok {
				continue
			}
			rw.mu.Lock()
			rw.events = append(rw.events, fmt.Sprintf("%s %s %s", ev.Type, u.GetName(), policies(u)))
			rw.mu.Unlock()
		}
	}()
	rw.stop = func() { cancel(); w.Stop(); <-done }
	return rw
}

// seen returns the events so far.
func (rw *reportsWatch) seen() []string {
	rw.mu.Lock()
	defer rw.mu.Unlock()
	return append([]string(nil), rw.events...)
}

// saw says whether an event of type typ showed report name with policy.
func (rw *reportsWatch) saw(typ watch.EventType, name, policy string) bool {
	for _, e := range rw.seen() {
		f := strings.Fields(e)
		if len(f) >= 2 && f[0] == string(typ) && f[1] == name && (policy == "" || len(f) == 3 && strings.Contains(","+f[2]+",", ","+policy+",")) {
			return true
		}
	}
	return false
}

// waitSaw waits up to d for saw.
func (rw *reportsWatch) waitSaw(t *testing.T, d time.Duration, typ watch.EventType, name, policy string) {
	t.Helper()
	for deadline := time.Now().Add(d); !rw.saw(typ, name, policy); time.Sleep(200 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Errorf("no %s of ClusterReport %s (%s) within %s; seen: %v", typ, name, policy, d, rw.seen())
			return
		}
	}
}

func policies(u *unstructured.Unstructured) string {
	res, _, _ := unstructured.NestedSlice(u.Object, "results")
	set := map[string]bool{}
	for _, r := range res {
		if m, ok := r.(map[string]any); ok {
			set[fmt.Sprint(m["policy"])] = true
		}
	}
	var out []string
	for p := range set {
		out = append(out, p)
	}
	sort.Strings(out)
	return strings.Join(out, ",")
}

// waitNoReports waits up to d until the API holds none of proxyaudit's
// ClusterReports (after helm uninstall: the garbage collector deletes
// them with the chart's ClusterRole, their owner).
func waitNoReports(ctx context.Context, t *testing.T, c *localcluster.Cluster, d time.Duration) {
	t.Helper()
	dc, err := dynamic.NewForConfig(c.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(d); ; time.Sleep(time.Second) {
		l, err := dc.Resource(openreports.Resource).List(ctx, metav1.ListOptions{LabelSelector: openreports.LabelManagedBy + "=" + openreports.Source})
		if err == nil && len(l.Items) == 0 {
			return
		}
		if time.Now().After(deadline) {
			var names []string
			if l != nil {
				for _, it := range l.Items {
					names = append(names, it.GetName())
				}
			}
			t.Errorf("ClusterReports left %s after helm uninstall: %v %v", d, names, err)
			return
		}
	}
}
