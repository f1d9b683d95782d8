package remediate

import (
	"strings"
	"testing"
)

func TestBudgetForms(t *testing.T) {
	for _, c := range []struct {
		in   string
		want map[int]int // fleet size -> nodes allowed
	}{
		{"0", map[int]int{0: 0, 3: 0, 5000: 0}},
		{"3", map[int]int{0: 3, 1: 3, 5000: 3}},
		{"10%", map[int]int{3: 0, 9: 0, 10: 1, 19: 1, 5000: 500}},
		{"33.4%", map[int]int{3: 1, 5000: 1670}},
		{"100%", map[int]int{3: 3, 5000: 5000}},
		{"-1", map[int]int{0: 0, 1: 0, 3: 2, 5000: 4999}},
		{" -0 ", map[int]int{3: 3}},
		{"-5", map[int]int{3: 0, 6: 1}},
	} {
		b, err := ParseBudget(c.in)
		if err != nil {
			t.Fatalf("%q: %v", c.in, err)
		}
		for size, want := range c.want {
			if got := b.Of(size); got != want {
				t.Errorf("%q of %d nodes: %d, want %d", c.in, size, got, want)
			}
		}
		again, err := ParseBudget(b.String())
		if err != nil || again != b {
			t.Errorf("%q prints as %q, which reads back as %v (%v)", c.in, b.String(), again, err)
		}
	}
}

func TestBudgetRefusesWhatItCannotMean(t *testing.T) {
	for _, in := range []string{"", "x", "1.5", "-1.5", "--1", "-+1", "+-1", "101%", "-3%", "%", "NaN%", "0.1", "1e3"} {
		if b, err := ParseBudget(in); err == nil {
			t.Errorf("%q read as %v", in, b)
		} else if !strings.Contains(err.Error(), "all but N nodes (-2)") {
			t.Errorf("%q: %v does not say what to write", in, err)
		}
	}
}
