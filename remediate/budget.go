package remediate

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// Budget is how many nodes may be in remediation at once, in
// NodeHealthCheck's forms: an absolute number ("3"), a share of the fleet
// ("10%", rounded down as NodeHealthCheck rounds maxUnhealthy), or every
// node but N ("-2"). The zero Budget allows none.
type Budget struct {
	n       int
	percent float64
	form    byte // 0: absolute; '%': percent; '-': all but n
}

// ParseBudget reads a budget: "3", "10%", "-2".
func ParseBudget(s string) (Budget, error) {
	t := strings.TrimSpace(s)
	bad := func(why string) (Budget, error) {
		return Budget{}, fmt.Errorf("remediation budget %q: %s; write a number of nodes (3), a share of the fleet (10%%), or all but N nodes (-2)", s, why)
	}
	switch {
	case t == "":
		return bad("empty")
	case strings.HasSuffix(t, "%"):
		p, err := strconv.ParseFloat(strings.TrimSuffix(t, "%"), 64)
		if err != nil || math.IsNaN(p) || p < 0 || p > 100 {
			return bad("a percentage from 0% to 100%")
		}
		return Budget{percent: p, form: '%'}, nil
	case strings.HasPrefix(t, "-"):
		n, err := strconv.Atoi(t[1:])
		if err != nil || n < 0 || strings.HasPrefix(t[1:], "-") || strings.HasPrefix(t[1:], "+") {
			return bad("all but a whole number of nodes")
		}
		return Budget{n: n, form: '-'}, nil
	}
	n, err := strconv.Atoi(t)
	if err != nil || n < 0 {
		return bad("not a whole number of nodes")
	}
	return Budget{n: n}, nil
}

// MustBudget is ParseBudget for constants.
func MustBudget(s string) Budget {
	b, err := ParseBudget(s)
	if err != nil {
		panic(err)
	}
	return b
}

// Of is the number of nodes the budget allows in a fleet of size nodes.
func (b Budget) Of(size int) int {
	switch b.form {
	case '%':
		return int(math.Floor(b.percent * float64(size) / 100))
	case '-':
		return max(size-b.n, 0)
	}
	return b.n
}

// String is the budget as written.
func (b Budget) String() string {
	switch b.form {
	case '%':
		return strconv.FormatFloat(b.percent, 'f', -1, 64) + "%"
	case '-':
		return "-" + strconv.Itoa(b.n)
	}
	return strconv.Itoa(b.n)
}

// Set makes a Budget a command-line flag.
func (b *Budget) Set(s string) error {
	v, err := ParseBudget(s)
	if err != nil {
		return err
	}
	*b = v
	return nil
}
