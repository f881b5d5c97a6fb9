package consumer

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/custody-go/custody/adapters"
)

// attemptContext is the context one handler attempt runs with. It is done
// when the attempt's parent is (the shutdown deadline), when the delivery is
// lost (its cause, ErrLeaseLost or adapters.ErrRevoked say, is what
// context.Cause returns), and once the attempt has ended.
//
// It is built lazily, for the sake of handlers that never look at their
// context: a context.WithCancelCause per attempt costs an allocation, a
// registration with the parent's children and a callback on the delivery,
// which is most of the runtime's cost for a quick handler. Until a handler
// (or a context derived from its own) asks for Done or the cancel cause,
// Err is answered from the delivery's and the parent's state; the first such
// request builds the real cancellable context, which from then on answers
// everything.
type attemptContext struct {
	parent context.Context
	d      *adapters.Delivery
	// state moves from attemptFresh to attemptBuilt (build) or
	// attemptEnded or attemptEndedLost (end), and from attemptBuilt to
	// attemptEnded. An attempt whose context was never built ends with one
	// compare-and-swap.
	state atomic.Int32

	mu sync.Mutex // held while building built
	// ready is set once built is: built is written before ready is set
	// and read after it is seen set, so without the lock. A flag, not a
	// pointer to built, keeps the struct (embedded in every job) at 64
	// bytes: it fills the padding after state and mu.
	ready atomic.Bool
	built builtContext
}

const (
	attemptFresh int32 = iota
	attemptBuilt
	attemptEnded
	// attemptEndedLost is attemptEnded for an attempt that ended unbuilt
	// after its delivery was lost: a context built afterwards reports the
	// loss as its cause, as it would have had it been built before.
	attemptEndedLost
)

type builtContext struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
}

// real returns the built context, or nil while there is none.
func (a *attemptContext) real() *builtContext {
	if a.ready.Load() {
		return &a.built
	}
	return nil
}

// cancelCtxKey is the key context.Cause and the context package's child
// registration look up to find the nearest cancellable context. It is
// unexported, so it is learnt once from a probe. Should a future Go ask
// differently, the key stays nil and attempt contexts are built eagerly.
var cancelCtxKey = func() any {
	var p keyProbe
	_ = context.Cause(&p)
	return p.key
}()

type keyProbe struct {
	context.Context
	key any
}

func (p *keyProbe) Err() error { return context.Canceled }

func (p *keyProbe) Value(key any) any {
	p.key = key
	return nil
}

// startAttempt returns the context of an attempt of d's handler under
// parent. a is where it lives (the job embeds the first attempt's, to save
// an allocation), or nil to allocate one. end must be called once the
// handler returned.
func startAttempt(a *attemptContext, parent context.Context, d *adapters.Delivery) *attemptContext {
	if a == nil {
		a = new(attemptContext)
	}
	a.parent, a.d = parent, d
	if cancelCtxKey == nil {
		a.build()
	}
	return a
}

// end cancels the attempt's context: a handler may have handed it to work
// that outlives the attempt.
func (a *attemptContext) end() {
	ended := attemptEnded
	if a.d.Signal.LostCause() != nil {
		ended = attemptEndedLost
	}
	if a.state.CompareAndSwap(attemptFresh, ended) {
		return // never built: nothing registered, nothing to cancel
	}
	// Built, or being built: the lock waits for built to be ready.
	a.mu.Lock()
	a.state.Store(attemptEnded)
	b := a.real()
	a.mu.Unlock()
	if b != nil {
		a.d.Signal.OnLost(nil)
		b.cancel(nil)
	}
}

// build makes the real context, once.
func (a *attemptContext) build() *builtContext {
	if b := a.real(); b != nil {
		return b
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if b := a.real(); b != nil {
		return b
	}
	parent := a.parent
	if a.d.Signal.LostCause() != nil {
		// Lost already: the loss came first, whatever the parent did since,
		// so the loss's cause is the one to report.
		parent = context.WithoutCancel(parent)
	}
	ctx, cancel := context.WithCancelCause(parent)
	a.built = builtContext{ctx: ctx, cancel: cancel}
	b := &a.built
	if a.state.CompareAndSwap(attemptFresh, attemptBuilt) {
		a.d.Signal.OnLost(cancel) // calls cancel at once if the delivery is lost
	} else {
		// The attempt ended first; after a loss, which is then the cause.
		var cause error
		if a.state.Load() == attemptEndedLost {
			cause = a.d.Signal.LostCause()
		}
		cancel(cause)
	}
	a.ready.Store(true)
	return b
}

func (a *attemptContext) Deadline() (time.Time, bool) { return a.parent.Deadline() }

func (a *attemptContext) Done() <-chan struct{} { return a.build().ctx.Done() }

func (a *attemptContext) Err() error {
	if b := a.real(); b != nil {
		return b.ctx.Err()
	}
	if a.state.Load() >= attemptEnded || a.d.Signal.LostCause() != nil {
		// Built now, Done would be closed at once.
		return context.Canceled
	}
	return a.parent.Err()
}

func (a *attemptContext) Value(key any) any {
	if key == cancelCtxKey {
		// context.Cause, or a context derived from this one looking for
		// the cancellable context to register with: from here on the real
		// one answers.
		return a.build().ctx.Value(key)
	}
	if b := a.real(); b != nil {
		return b.ctx.Value(key)
	}
	return a.parent.Value(key)
}

// String names the context the way the context package names its own.
func (a *attemptContext) String() string { return "consumer.attemptContext" }
