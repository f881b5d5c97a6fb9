package backoff

import (
	"math"
	"testing"
	"time"
)

func TestExponentialGrowsCapsAndJitters(t *testing.T) {
	e := Exponential{Initial: 100 * time.Millisecond, Max: time.Second, Multiplier: 2}
	want := []time.Duration{100, 200, 400, 800, 1000, 1000}
	for i, w := range want {
		if got := e.Delay(i + 1); got != w*time.Millisecond {
			t.Errorf("Delay(%d) = %v, want %v", i+1, got, w*time.Millisecond)
		}
	}
	if got := e.Delay(10000); got != time.Second {
		t.Errorf("Delay(10000) = %v, want the cap", got)
	}
	e.Jitter = 0.5
	seen := map[time.Duration]bool{}
	for i := 0; i < 100; i++ {
		d := e.Delay(3)
		if d < 200*time.Millisecond || d > 400*time.Millisecond {
			t.Fatalf("jittered delay %v outside [200ms, 400ms]", d)
		}
		seen[d] = true
	}
	if len(seen) < 10 {
		t.Fatalf("jitter produced only %d distinct delays", len(seen))
	}
}

// Without a Max the delay grows until it no longer fits a time.Duration; it
// must stop there, not wrap to a negative delay (a retry with no wait).
func TestUncappedDelayStopsAtTheLargestDuration(t *testing.T) {
	for _, e := range []Exponential{
		{Initial: 200 * time.Millisecond, Multiplier: 2},
		{Initial: 200 * time.Millisecond, Multiplier: 2, Jitter: 0.5},
		{Initial: time.Second, Multiplier: math.Inf(1)},
	} {
		prev := time.Duration(0)
		for n := 1; n <= 2000; n++ {
			d := e.Delay(n)
			if d <= 0 {
				t.Fatalf("%+v: Delay(%d) = %v", e, n, d)
			}
			if e.Jitter == 0 && d < prev {
				t.Fatalf("%+v: Delay(%d) = %v, less than Delay(%d) = %v", e, n, d, n-1, prev)
			}
			prev = d
		}
		if e.Jitter == 0 && prev != time.Duration(math.MaxInt64) {
			t.Errorf("%+v: Delay(2000) = %v, want the largest Duration", e, prev)
		}
	}
}

// FuzzExponentialDelay checks Delay against the policy's promise for any
// valid settings: never below the jitter's floor of the exact delay, never
// above it or Max, and never negative.
func FuzzExponentialDelay(f *testing.F) {
	f.Add(int64(200*time.Millisecond), int64(time.Minute), 2.0, 0.5, 40)
	f.Add(int64(time.Millisecond), int64(0), 10.0, 0.0, 1000)
	f.Fuzz(func(t *testing.T, initial, maxDelay int64, mult, jitter float64, n int) {
		if initial <= 0 || maxDelay < 0 || (maxDelay > 0 && maxDelay < initial) ||
			!(mult >= 1) || !(jitter >= 0 && jitter <= 1) {
			t.Skip() // settings the consumer options refuse
		}
		n %= 5000 // keeps the reference loop short
		e := Exponential{Initial: time.Duration(initial), Max: time.Duration(maxDelay), Multiplier: mult, Jitter: jitter}
		d := e.Delay(n)
		// The reference: exact growth in big steps, capped.
		limit := math.MaxInt64 * 1.0
		if maxDelay > 0 {
			limit = float64(maxDelay)
		}
		exact := float64(initial)
		for i := 1; i < max(n, 1) && exact < limit; i++ {
			exact *= mult
		}
		exact = math.Min(exact, limit)
		if d < 0 {
			t.Fatalf("%+v: Delay(%d) = %v, negative", e, n, d)
		}
		if float64(d) > exact*(1+1e-9)+1 {
			t.Fatalf("%+v: Delay(%d) = %v, above the exact delay %v", e, n, d, time.Duration(exact))
		}
		if floor := exact * (1 - jitter); float64(d) < floor*(1-1e-9)-1 {
			t.Fatalf("%+v: Delay(%d) = %v, below the jitter floor %v", e, n, d, time.Duration(floor))
		}
	})
}
