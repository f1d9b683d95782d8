//go:build race

package stream

// raceEnabled: the race detector changes what allocates (escape
// analysis), so allocation bounds are not checked under it.
const raceEnabled = true
