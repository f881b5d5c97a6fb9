package pace

import (
	"context"
	"errors"
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
