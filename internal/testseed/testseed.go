// Package testseed runs the rounds of a randomized test, each with a seed of
// its own that the test logs and that an environment variable replays.
package testseed

import (
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"
)

// The environment variables Rounds reads: SeedEnv replays one round with
// that seed; RoundsEnv runs that many rounds instead of the default.
const (
	SeedEnv   = "CUSTODY_SOAK_SEED"
	RoundsEnv = "CUSTODY_SOAK_ROUNDS"
)

// Rounds runs round as subtests named after their seeds: n of them (or
// RoundsEnv's count) with consecutive seeds from the clock, or the one seed
// SeedEnv gives.
func Rounds(t *testing.T, n int, round func(t *testing.T, seed uint64)) {
	t.Helper()
	if v, err := strconv.Atoi(os.Getenv(RoundsEnv)); err == nil && v > 0 {
		n = v
	}
	seed := uint64(time.Now().UnixNano())
	if v, err := strconv.ParseUint(os.Getenv(SeedEnv), 10, 64); err == nil {
		seed, n = v, 1
	}
	for i := range n {
		s := seed + uint64(i)
		t.Run(fmt.Sprintf("seed=%d", s), func(t *testing.T) { round(t, s) })
	}
}
