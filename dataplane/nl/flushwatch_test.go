package nl

import "testing"

// The dispatch count trips at the end of a commit that leaves a family's
// dispatch at half or less of what the last read saw, and only then:
// kube-proxy's sync (every rule deleted and added again in one commit)
// never trips it, a flush does even when the next commit writes the
// dispatch back, and a read starts the count afresh.
func TestFlushWatch(t *testing.T) {
	rules := func(w *FlushWatch, i, n int) {
		for range max(n, -n) {
			if n > 0 {
				w.Rule(i, 1)
			} else {
				w.Rule(i, -1)
			}
		}
	}
	var w FlushWatch
	w.Rebase(0, 100)
	// kube-proxy's sync: deleted and added in one commit.
	rules(&w, 0, -100)
	rules(&w, 0, 100)
	w.Commit()
	if w.Tripped {
		t.Fatal("a rewrite of the dispatch in one commit tripped")
	}
	// Services removed: 40 of 100, not a flush.
	rules(&w, 0, -40)
	w.Commit()
	if w.Tripped {
		t.Fatal("40 of 100 rules gone tripped")
	}
	// A flush, then kube-proxy's next sync writes it back: the first
	// commit trips.
	w.Take()
	w.Rebase(0, 60)
	rules(&w, 0, -60)
	w.Commit()
	rules(&w, 0, 60)
	w.Commit()
	if !w.Tripped {
		t.Fatal("a flush followed by a rewrite did not trip")
	}
	// A read takes the notes: afresh.
	w.Take()
	w.Rebase(0, 60)
	if w.Tripped {
		t.Fatal("still tripped after a read")
	}
	// The IPv6 family's table deleted, where the last read saw rules.
	w.Rebase(1, 10)
	w.TableGone(1)
	w.Commit()
	if !w.Tripped {
		t.Fatal("the table deleted did not trip")
	}
	// A family without rules at the last read never trips.
	var e FlushWatch
	e.TableGone(0)
	rules(&e, 1, -5)
	e.Commit()
	if e.Tripped {
		t.Fatal("a family without rules tripped")
	}
	// Notes that arrive while a read is on its way stay counted after it.
	var r FlushWatch
	r.Rebase(0, 100)
	r.Take()
	rules(&r, 0, -80) // after the read took the notes
	r.Rebase(0, 100)  // the read saw all 100
	r.Commit()
	if !r.Tripped {
		t.Fatal("a flush during a read was forgotten by the read's rebase")
	}
}
