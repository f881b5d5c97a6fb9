package consumer

import "context"

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
func Chain(h Handler, mw ...Middleware) Handler {
	for i := len(mw) - 1; i >= 0; i-- {
		h = mw[i](h)
	}
	return h
}
