package consumer

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

type ctxKey struct{}

// attemptUnder starts an attempt of a fresh delivery under a cancellable
// parent carrying a value.
func attemptUnder(t *testing.T) (*attemptContext, *adapters.Delivery, context.CancelCauseFunc) {
	t.Helper()
	parent, cancel := context.WithCancelCause(context.WithValue(context.Background(), ctxKey{}, "v"))
	t.Cleanup(func() { cancel(nil) })
	d := &adapters.Delivery{Signal: new(adapters.Signal), ID: "m"}
	return startAttempt(nil, parent, d), d, cancel
}

func isDone(ctx context.Context) bool {
	select {
	case <-ctx.Done():
		return true
	default:
		return false
	}
}

func TestAttemptContextProbeFoundTheCancelKey(t *testing.T) {
	if cancelCtxKey == nil {
		t.Fatal("the probe did not learn the context package's cancel key: every attempt builds its context eagerly (correct, but slower); see attemptctx.go")
	}
}

func TestAttemptContextLiveUntilSomethingEnds(t *testing.T) {
	a, _, _ := attemptUnder(t)
	if a.Err() != nil || context.Cause(a) != nil || isDone(a) {
		t.Fatalf("a fresh attempt's context is done: err %v, cause %v", a.Err(), context.Cause(a))
	}
	if v := a.Value(ctxKey{}); v != "v" {
		t.Fatalf("Value = %v, want the parent's value", v)
	}
}

// The loss's cause reaches the handler whether it asked for Done before the
// loss (the context was built and the delivery cancels it) or only after it
// (the context is built already cancelled).
func TestAttemptContextLossCause(t *testing.T) {
	for _, askFirst := range []bool{true, false} {
		a, d, _ := attemptUnder(t)
		var derived context.Context
		if askFirst {
			_ = a.Done()
			var cancel context.CancelFunc
			derived, cancel = context.WithCancel(a)
			defer cancel()
		}
		d.Signal.Lose(adapters.ErrLeaseLost)
		if !errors.Is(a.Err(), context.Canceled) {
			t.Fatalf("askFirst=%v: Err = %v, want context.Canceled", askFirst, a.Err())
		}
		if got := context.Cause(a); !errors.Is(got, adapters.ErrLeaseLost) {
			t.Fatalf("askFirst=%v: Cause = %v, want ErrLeaseLost", askFirst, got)
		}
		if !isDone(a) {
			t.Fatalf("askFirst=%v: Done not closed after the loss", askFirst)
		}
		if derived != nil {
			if got := context.Cause(derived); !errors.Is(got, adapters.ErrLeaseLost) {
				t.Fatalf("derived context's Cause = %v, want ErrLeaseLost", got)
			}
		}
	}
}

// A context derived before anything ended is registered with the attempt's
// and ends with it.
func TestAttemptContextDerivedEndsWithTheLoss(t *testing.T) {
	a, d, _ := attemptUnder(t)
	derived, cancel := context.WithTimeout(a, time.Hour)
	defer cancel()
	if isDone(derived) {
		t.Fatal("derived context done before anything ended")
	}
	d.Signal.Lose(adapters.ErrRevoked)
	select {
	case <-derived.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("derived context not cancelled by the loss")
	}
	if got := context.Cause(derived); !errors.Is(got, adapters.ErrRevoked) {
		t.Fatalf("Cause = %v, want ErrRevoked", got)
	}
	if v := derived.Value(ctxKey{}); v != "v" {
		t.Fatalf("Value through a derived context = %v", v)
	}
}

func TestAttemptContextParentCause(t *testing.T) {
	for _, askFirst := range []bool{true, false} {
		a, _, cancel := attemptUnder(t)
		if askFirst {
			_ = a.Done()
		}
		cancel(ErrShutdownTimeout)
		if got := context.Cause(a); !errors.Is(got, ErrShutdownTimeout) {
			t.Fatalf("askFirst=%v: Cause = %v, want ErrShutdownTimeout", askFirst, got)
		}
		if !isDone(a) || a.Err() == nil {
			t.Fatalf("askFirst=%v: not done after the parent", askFirst)
		}
	}
}

// A loss before the parent's end is what the handler is told, even when it
// asks only after both.
func TestAttemptContextLossBeforeParent(t *testing.T) {
	a, d, cancel := attemptUnder(t)
	d.Signal.Lose(adapters.ErrLeaseLost)
	cancel(ErrShutdownTimeout)
	if got := context.Cause(a); !errors.Is(got, adapters.ErrLeaseLost) {
		t.Fatalf("Cause = %v, want ErrLeaseLost", got)
	}
}

// A handler may hand its context to work that outlives the attempt: the end
// of the attempt cancels it, built or not, and detaches it from the
// delivery.
func TestAttemptContextEnd(t *testing.T) {
	for _, askFirst := range []bool{true, false} {
		a, d, _ := attemptUnder(t)
		if askFirst {
			_ = a.Done()
		}
		a.end()
		if !isDone(a) || !errors.Is(a.Err(), context.Canceled) {
			t.Fatalf("askFirst=%v: not cancelled by the end of the attempt", askFirst)
		}
		if got := context.Cause(a); !errors.Is(got, context.Canceled) {
			t.Fatalf("askFirst=%v: Cause = %v, want context.Canceled", askFirst, got)
		}
		// The next attempt's context takes the delivery's loss.
		next := startAttempt(nil, context.Background(), d)
		_ = next.Done()
		d.Signal.Lose(adapters.ErrLeaseLost)
		if got := context.Cause(next); !errors.Is(got, adapters.ErrLeaseLost) {
			t.Fatalf("askFirst=%v: the next attempt's Cause = %v, want ErrLeaseLost", askFirst, got)
		}
		next.end()
	}
}

// Building the context races the attempt's end when the handler leaked it to
// a goroutine; run with -race.
func TestAttemptContextBuildRacesEnd(t *testing.T) {
	for i := 0; i < 200; i++ {
		a, d, _ := attemptUnder(t)
		var wg sync.WaitGroup
		wg.Add(3)
		go func() { defer wg.Done(); <-a.Done() }()
		go func() { defer wg.Done(); _ = context.Cause(a) }()
		go func() { defer wg.Done(); a.end() }()
		wg.Wait()
		if !isDone(a) {
			t.Fatal("not done after end")
		}
		d.Signal.Lose(nil) // no callback of the ended attempt is left to run
	}
}

// An attempt whose handler never looks at its context costs nothing: no
// allocation, no registration with the parent.
func TestAttemptContextUnusedAllocatesNothing(t *testing.T) {
	parent, cancel := context.WithCancel(context.Background())
	defer cancel()
	d := &adapters.Delivery{Signal: new(adapters.Signal), ID: "m"}
	var a attemptContext
	allocs := testing.AllocsPerRun(100, func() {
		a = attemptContext{}
		ac := startAttempt(&a, parent, d)
		if ac.Err() != nil {
			t.Fatal("done")
		}
		ac.end()
	})
	if allocs != 0 {
		t.Fatalf("an unused attempt context allocated %v times, want 0", allocs)
	}
}

// A handler that asks for its context's Done pays for the cancellable
// context it builds, and for nothing more.
func TestAttemptContextBuiltAllocatesOnlyTheCancelContext(t *testing.T) {
	parent, cancel := context.WithCancel(context.Background())
	defer cancel()
	d := &adapters.Delivery{Signal: new(adapters.Signal), ID: "m"}
	var a attemptContext
	allocs := testing.AllocsPerRun(100, func() {
		a = attemptContext{}
		ac := startAttempt(&a, parent, d)
		_ = ac.Done()
		ac.end()
	})
	plain := testing.AllocsPerRun(100, func() {
		ctx, c := context.WithCancelCause(parent)
		_ = ctx.Done()
		c(nil)
	})
	if allocs > plain {
		t.Fatalf("building an attempt context allocated %v times, a plain context.WithCancelCause %v", allocs, plain)
	}
}
