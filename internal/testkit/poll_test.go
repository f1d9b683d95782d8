package testkit

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

type fakeT struct{ failed string }

func (f *fakeT) Helper() {}
func (f *fakeT) Fatalf(format string, args ...any) {
	f.failed = fmt.Sprintf(format, args...)
}

func TestEventuallyReturnsOnceTheConditionHolds(t *testing.T) {
	n := 0
	took := Eventually(t, time.Second, "the third call", func() bool { n++; return n == 3 })
	if n != 3 || took > 500*time.Millisecond {
		t.Fatalf("calls %d, took %s", n, took)
	}
}

func TestEventuallyFailsWithOneMessage(t *testing.T) {
	f := &fakeT{}
	Eventually(f, 30*time.Millisecond, "what never comes", func() bool { return false })
	if f.failed != "after 30ms, still waiting for what never comes" {
		t.Fatalf("message %q", f.failed)
	}
	if got := Waiting(time.Second, "x", "a\nb"); !strings.HasSuffix(got, "last seen:\na\nb") {
		t.Fatalf("message %q", got)
	}
}

func TestAwaitSaysWhatItSawLast(t *testing.T) {
	f := &fakeT{}
	n, described := 0, 0
	Await(f, 30*time.Millisecond, "the node in sync", func() bool { n++; return false },
		func() string { described++; return fmt.Sprintf("call %d", n) })
	if want := fmt.Sprintf("after 30ms, still waiting for the node in sync; last seen:\ncall %d", n); f.failed != want {
		t.Fatalf("message %q, want %q", f.failed, want)
	}
	if described != 1 {
		t.Fatalf("seen called %d times, want once (at the end)", described)
	}
	f = &fakeT{}
	if Await(f, time.Second, "x", func() bool { return true }, func() string { t.Fatal("seen called on success"); return "" }); f.failed != "" {
		t.Fatalf("failed: %s", f.failed)
	}
}
