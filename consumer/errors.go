package consumer

import (
	"errors"
	"fmt"
	"time"
)

// Permanent marks err as one that no retry can fix (a message that cannot be
// parsed, a reference to something that does not exist). The runtime sends the
// message to the dead-letter destination at once. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err}
}

type permanentError struct{ err error }

func (e *permanentError) Error() string { return "permanent: " + e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// IsPermanent reports whether err, or an error it wraps, was marked Permanent.
func IsPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}

// RetryAfter asks for the next attempt no sooner than d, overriding the
// backoff policy for this retry. It still counts as an attempt. A d of zero
// or less means the policy's backoff; the runtime waits at least a
// millisecond either way. RetryAfter(nil, d) is nil.
func RetryAfter(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	return &retryAfterError{err: err, after: d}
}

// Defer asks for the message again no sooner than d, without counting the
// attempt against the retry policy's MaxAttempts where the runtime counts
// attempts itself (see below for brokers that count them): for a message
// that cannot be handled yet for a reason outside it, such as a duplicate
// whose original is still running elsewhere. A deferred message is never
// dead-lettered for running out of attempts, however often it is deferred;
// only a failure of its own (or a Permanent error) can send it there.
//
// Where the runtime waits in place (ordered lanes, brokers without delayed
// redelivery or without a delivery count), a deferral leaves Message.Attempt
// as it was. Where the broker redelivers the message after the delay and
// counts deliveries itself (SQS, RabbitMQ, the memory broker), the next
// delivery's Attempt is one higher, and a broker's own redrive policy (an SQS
// maxReceiveCount, a memory queue's MaxReceiveCount) still counts it. So does
// MaxAttempts, which reads that count: once deferred MaxAttempts-1 times or
// more, the message is dead-lettered at its first failure of its own, without
// a retry.
//
// A deferral is no failure in the telemetry either (see the package
// documentation, section Telemetry). A d of zero or less means the retry
// policy's backoff: a deferral has no attempt limit to stop it, so it must
// never come back at once (the runtime waits at least a millisecond,
// whatever d). Defer(nil, d) is nil.
func Defer(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	return &retryAfterError{err: err, after: d, deferred: true}
}

type retryAfterError struct {
	err      error
	after    time.Duration
	deferred bool
}

func (e *retryAfterError) Error() string {
	if e.deferred {
		return fmt.Sprintf("deferred for %v: %v", e.after, e.err)
	}
	return fmt.Sprintf("retry after %v: %v", e.after, e.err)
}
func (e *retryAfterError) Unwrap() error { return e.err }

// RetryDelay reports the delay asked for with RetryAfter or Defer, if err (or
// an error it wraps) carries one.
func RetryDelay(err error) (time.Duration, bool) {
	var r *retryAfterError
	if errors.As(err, &r) {
		return r.after, true
	}
	return 0, false
}

// IsDeferred reports whether err, or an error it wraps, was made with Defer.
func IsDeferred(err error) bool {
	var r *retryAfterError
	return errors.As(err, &r) && r.deferred
}

// Unavailable marks err as the failure of something the message depends
// on rather than of the message: a database or downstream service that is
// down, an idempotency store that does not answer. A message is
// dead-lettered for its own failures only, so an unavailable attempt uses up
// no attempt and never sends the message to the dead-letter destination,
// however long the outage lasts.
//
// The message waits in place (see the package documentation, section
// Handling), its handler tried again after the retry policy's backoff for
// the number of consecutive unavailable attempts (or the delay asked for
// with RetryAfter or Defer around it). It waits in place even where the
// broker could hold it back: a redelivery would raise the broker's delivery
// count, which MaxAttempts and a broker's redrive policy read. At shutdown
// it is given back at once, as one waiting for a retry is; at the maximum
// processing time ([WithMaxProcessingTime]) the broker delivers it again.
//
// An error marked both Unavailable and [Permanent] is treated as
// Unavailable. Such attempts are counted (custody.handler.unavailable) and
// logged. Unavailable(nil) is nil.
func Unavailable(err error) error {
	if err == nil {
		return nil
	}
	return &unavailableError{err}
}

type unavailableError struct{ err error }

func (e *unavailableError) Error() string { return "dependency unavailable: " + e.err.Error() }
func (e *unavailableError) Unwrap() error { return e.err }

// IsUnavailable reports whether err, or an error it wraps, was marked
// Unavailable.
func IsUnavailable(err error) bool {
	var u *unavailableError
	return errors.As(err, &u)
}

// PanicError is the error a recovered handler panic becomes, and the one
// that replaces a returned error whose Error, Unwrap or As method panics. It
// is retried and dead-lettered like any other error.
type PanicError struct {
	Value any
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("handler panicked: %v", e.Value) }

// ErrHandlerExited is the error recorded for an attempt whose handler ended
// its goroutine with runtime.Goexit instead of returning: t.FailNow, or
// testify's require, called in a handler under test. The message is given
// back at once (behind it, the rest of its lane), and the runtime replaces
// the worker the handler ended.
var ErrHandlerExited = errors.New("custody: the handler called runtime.Goexit instead of returning (t.FailNow or require in a handler?)")

// Causes the runtime gives handler contexts when it cancels them; read them
// with context.Cause.
var (
	// ErrShutdownTimeout: the shutdown timeout passed, or Shutdown's
	// context ended, while the handler ran. The message is given back to
	// the broker (left to its lease with WithLeaveUnfinishedOnShutdown).
	ErrShutdownTimeout = errors.New("custody: shutdown timeout reached; the message is given back to the broker")
	// ErrHandlerTimeout: the handler ran longer than WithHandlerTimeout.
	ErrHandlerTimeout = errors.New("custody: handler timeout reached")
)
