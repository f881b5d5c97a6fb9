package pace

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

// Five operations at 20 a second take at least four intervals: the bound
// is a floor, which a slow machine only exceeds.
func TestWaitSpacesOperations(t *testing.T) {
	p := New(20)
	start := time.Now()
	for range 5 {
		if err := p.Wait(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if took, floor := time.Since(start), 4*p.Interval(); took < floor {
		t.Fatalf("5 operations at 20/s took %v, less than %v", took, floor)
	}
}

// Ready does not use up the slot it waits for.
func TestReadyTakesNoSlot(t *testing.T) {
	p := New(1)
	if err := p.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	if err := p.Ready(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Ready within the interval: %v, want the context's deadline", err)
	}
	fresh := New(1)
	for range 3 {
		if err := fresh.Ready(context.Background()); err != nil {
			t.Fatalf("Ready before any operation: %v", err)
		}
	}
	if err := fresh.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// A cancelled Wait counts nothing: the next Wait may start at once.
func TestCancelledWaitCountsNothing(t *testing.T) {
	p := New(1)
	p.Wait(context.Background())
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := p.Wait(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait on a cancelled context: %v", err)
	}
	if !p.next.After(time.Now()) {
		t.Fatal("the first slot was given up")
	}
}

// ForReplay refuses negative and NaN rates and a negative bound, naming the
// field, and paces a zero rate at DefaultReplayRate.
func TestForReplay(t *testing.T) {
	for _, c := range []struct {
		rate float64
		max  int
		bad  string
	}{
		{rate: -1, bad: "ReplayOptions.Rate"},
		{rate: math.NaN(), bad: "ReplayOptions.Rate"},
		{max: -1, bad: "ReplayOptions.Max"},
	} {
		if _, err := ForReplay(c.rate, c.max); err == nil || !strings.Contains(err.Error(), c.bad) {
			t.Errorf("ForReplay(%v, %d) = %v, want an error naming %s", c.rate, c.max, err, c.bad)
		}
	}
	p, err := ForReplay(0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if want := time.Second / DefaultReplayRate; p.Interval() != want {
		t.Errorf("ForReplay(0, 0) paces at %v, want %v", p.Interval(), want)
	}
}
