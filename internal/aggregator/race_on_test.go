//go:build race

package aggregator

// raceEnabled: the race detector slows memory-bound work several times
// over (64 MiB read from a hostile peer), so time bounds are checked
// without it.
const raceEnabled = true
