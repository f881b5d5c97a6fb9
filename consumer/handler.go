package consumer

import (
	"context"
	"errors"
	"fmt"
)

// Handler performs the effect of one message. Returning nil means the effect
// is complete and durable, and the runtime acks the message. Returning an
// error means it is not: the runtime retries it with backoff, or dead-letters
// it once attempts run out (at once for [Permanent] errors).
//
// Handle must honour ctx: it is cancelled when the message's lease is lost,
// when the handler timeout passes, and at the shutdown deadline.
// context.Cause(ctx) says which.
type Handler interface {
	Handle(ctx context.Context, m *Message) error
}

// HandlerFunc adapts an ordinary function to a Handler.
type HandlerFunc func(ctx context.Context, m *Message) error

// Handle calls f(ctx, m).
func (f HandlerFunc) Handle(ctx context.Context, m *Message) error { return f(ctx, m) }

// Middleware wraps a Handler with behaviour of its own: idempotency,
// logging, authorisation.
type Middleware func(Handler) Handler

// Chain wraps h in mw so that mw[0] is outermost: it sees the message first
// and the result last.
//
// A nil h or Middleware (one whose constructor failed, its error unchecked),
// or a Middleware that returns a nil Handler, makes Chain return a Handler
// that [New] refuses, with an error saying which. Chained again, that
// Handler stays as it is, so New still sees it; wrapped by anything else
// before New, it fails every attempt with [Unavailable]: the messages wait,
// none is dead-lettered or lost for the mistake.
func Chain(h Handler, mw ...Middleware) Handler {
	if _, broken := h.(brokenChain); broken {
		return h
	}
	if isNil(h) {
		return brokenChain{errors.New("consumer.Chain: the Handler is nil; pass the Handler the middleware wraps")}
	}
	for i := len(mw) - 1; i >= 0; i-- {
		if mw[i] == nil {
			return brokenChain{fmt.Errorf("consumer.Chain: middleware %d of %d is nil; check the error of the call that made it", i, len(mw))}
		}
		h = mw[i](h)
		if isNil(h) {
			return brokenChain{fmt.Errorf("consumer.Chain: middleware %d of %d returned a nil Handler", i, len(mw))}
		}
	}
	return h
}
