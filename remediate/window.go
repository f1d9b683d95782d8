package remediate

import (
	"fmt"
	"strings"
	"time"
)

// Window is a weekly maintenance window: the days it opens on, its start
// and length, in a time zone.
type Window struct {
	days   [7]bool // by time.Weekday
	start  time.Duration
	length time.Duration
	loc    *time.Location
	text   string
}

// Windows are the times remediation may act (kured's reboot windows);
// outside them it pages only. None means always.
type Windows []Window

var dayNames = map[string]time.Weekday{"sun": time.Sunday, "mon": time.Monday, "tue": time.Tuesday, "wed": time.Wednesday,
	"thu": time.Thursday, "fri": time.Friday, "sat": time.Saturday}

// ParseWindows reads windows separated by ";", each "DAYS HH:MM-HH:MM
// [ZONE]": DAYS is a day ("Mon"), a range ("Mon-Fri", "Fri-Mon"), a list
// of those ("Mon,Wed,Sat-Sun"), "daily" or "*"; ZONE an IANA name
// ("Europe/Berlin"; UTC when left out). A window whose end is not after
// its start runs past midnight into the next day ("Sat 22:00-04:00").
// The empty string is no windows: remediation may act at any time.
func ParseWindows(s string) (Windows, error) {
	var out Windows
	for _, part := range strings.Split(s, ";") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		w, err := parseWindow(part)
		if err != nil {
			return nil, fmt.Errorf("remediation window %q: %w (want e.g. \"Mon-Fri 09:00-17:00 Europe/Berlin\")", part, err)
		}
		out = append(out, w)
	}
	return out, nil
}

func parseWindow(s string) (Window, error) {
	f := strings.Fields(s)
	if len(f) < 2 || len(f) > 3 {
		return Window{}, fmt.Errorf("want DAYS HH:MM-HH:MM [ZONE]")
	}
	w := Window{loc: time.UTC, text: s}
	if err := w.parseDays(strings.ToLower(f[0])); err != nil {
		return Window{}, err
	}
	from, to, ok := strings.Cut(f[1], "-")
	if !ok {
		return Window{}, fmt.Errorf("times %q: want HH:MM-HH:MM", f[1])
	}
	start, err := clock(from)
	if err != nil {
		return Window{}, err
	}
	end, err := clock(to)
	if err != nil {
		return Window{}, err
	}
	w.start, w.length = start, end-start
	if w.length <= 0 {
		w.length += 24 * time.Hour
	}
	if len(f) == 3 {
		if w.loc, err = time.LoadLocation(f[2]); err != nil {
			return Window{}, fmt.Errorf("time zone %q: %w", f[2], err)
		}
	}
	return w, nil
}

func (w *Window) parseDays(s string) error {
	if s == "daily" || s == "*" {
		for i := range w.days {
			w.days[i] = true
		}
		return nil
	}
	for _, item := range strings.Split(s, ",") {
		a, b, isRange := strings.Cut(item, "-")
		first, ok := dayNames[a]
		if !ok {
			return fmt.Errorf("day %q: want Mon, Tue, Wed, Thu, Fri, Sat, Sun, a range of them, daily or *", a)
		}
		last := first
		if isRange {
			if last, ok = dayNames[b]; !ok {
				return fmt.Errorf("day %q: want Mon, Tue, Wed, Thu, Fri, Sat, Sun", b)
			}
		}
		for d := first; ; d = (d + 1) % 7 {
			w.days[d] = true
			if d == last {
				break
			}
		}
	}
	return nil
}

func clock(s string) (time.Duration, error) {
	t, err := time.Parse("15:04", s)
	if err != nil {
		if s == "24:00" {
			return 24 * time.Hour, nil
		}
		return 0, fmt.Errorf("time %q: want HH:MM", s)
	}
	return time.Duration(t.Hour())*time.Hour + time.Duration(t.Minute())*time.Minute, nil
}

// Open reports whether now is inside a window (always, without windows)
// and, when it is not, when the next window opens.
func (ws Windows) Open(now time.Time) (bool, time.Time) {
	if len(ws) == 0 {
		return true, time.Time{}
	}
	var next time.Time
	for _, w := range ws {
		local := now.In(w.loc)
		// Yesterday's window may still run (past midnight); the next
		// opening is within a week.
		for d := -1; d <= 7; d++ {
			day := time.Date(local.Year(), local.Month(), local.Day()+d, 0, 0, 0, 0, w.loc)
			if !w.days[day.Weekday()] {
				continue
			}
			// The wall clock's start that day (a DST change keeps it).
			h, m := int(w.start/time.Hour), int(w.start%time.Hour/time.Minute)
			start := time.Date(day.Year(), day.Month(), day.Day(), h, m, 0, 0, w.loc)
			end := start.Add(w.length)
			if !now.Before(start) && now.Before(end) {
				return true, time.Time{}
			}
			if start.After(now) && (next.IsZero() || start.Before(next)) {
				next = start
			}
		}
	}
	return false, next
}

// String is the windows as they were written.
func (ws Windows) String() string {
	parts := make([]string, len(ws))
	for i, w := range ws {
		parts[i] = w.text
	}
	return strings.Join(parts, "; ")
}
