package consumer

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// A delivery lost while its attempt ran tells the context's cause also to a
// goroutine that asks only after the attempt ended (the handler leaked its
// context, never looked at it while it ran), as the eagerly built context
// did: the loss came before the end.
func TestAttemptContextLossBeforeEndKeepsItsCause(t *testing.T) {
	a, d, _ := attemptUnder(t)
	d.Signal.Lose(adapters.ErrRevoked)
	a.end()
	if got := context.Cause(a); !errors.Is(got, adapters.ErrRevoked) {
		t.Fatalf("Cause after a loss and then the end = %v, want ErrRevoked", got)
	}
	if !isDone(a) {
		t.Fatal("not done")
	}
}

// A loss after the end does not change the cause: the end came first.
func TestAttemptContextLossAfterEndIsNotTheCause(t *testing.T) {
	for _, askFirst := range []bool{true, false} {
		a, d, _ := attemptUnder(t)
		if askFirst {
			_ = a.Done()
		}
		a.end()
		d.Signal.Lose(adapters.ErrRevoked)
		if got := context.Cause(a); got != context.Canceled {
			t.Fatalf("askFirst=%v: Cause = %v, want context.Canceled", askFirst, got)
		}
	}
}

// Contexts derived from an attempt's register with the context it builds
// (no goroutine of the context package watches them): they are cancelled
// synchronously with it, by the end, a loss, and the parent.
func TestAttemptContextDerivedAreCancelledSynchronously(t *testing.T) {
	type ender func(a *attemptContext, d *adapters.Delivery, parent context.CancelCauseFunc)
	enders := map[string]ender{
		"end": func(a *attemptContext, _ *adapters.Delivery, _ context.CancelCauseFunc) { a.end() },
		"loss": func(_ *attemptContext, d *adapters.Delivery, _ context.CancelCauseFunc) {
			d.Signal.Lose(adapters.ErrLeaseLost)
		},
		"parent": func(_ *attemptContext, _ *adapters.Delivery, c context.CancelCauseFunc) { c(ErrShutdownTimeout) },
	}
	derivers := map[string]func(context.Context) (context.Context, func()){
		"WithCancel": func(p context.Context) (context.Context, func()) {
			c, cancel := context.WithCancel(p)
			return c, cancel
		},
		"WithTimeout": func(p context.Context) (context.Context, func()) {
			c, cancel := context.WithTimeout(p, time.Hour)
			return c, cancel
		},
		"WithValueThenCancel": func(p context.Context) (context.Context, func()) {
			c, cancel := context.WithCancelCause(context.WithValue(p, ctxKey{}, "w"))
			return c, func() { cancel(nil) }
		},
	}
	for en, end := range enders {
		for dn, derive := range derivers {
			a, d, parent := attemptUnder(t)
			c, cancel := derive(a)
			fired := make(chan struct{})
			stop := context.AfterFunc(a, func() { close(fired) })
			end(a, d, parent)
			if c.Err() == nil {
				t.Errorf("%s, %s: the derived context was not cancelled at once", en, dn)
			}
			if stop() {
				t.Errorf("%s, %s: AfterFunc not started by the end of its context", en, dn)
			}
			<-fired
			want := map[string]error{"end": context.Canceled, "loss": adapters.ErrLeaseLost, "parent": ErrShutdownTimeout}[en]
			if got := context.Cause(c); got != want {
				t.Errorf("%s, %s: derived Cause = %v, want %v", en, dn, got, want)
			}
			cancel()
			a.end()
		}
	}
}
