package backoff

import (
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
