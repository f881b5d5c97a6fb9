package consumer

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// BatchHandler performs the effects of several messages at once: one
// multi-row insert, one bulk index request, one aggregated write. It
// records an outcome for each message of the batch with [Batch.Done] or
// [Batch.Fail]; each message is then settled as a [Handler] returning nil,
// or that error, would have it settled: acked, retried with its own backoff
// and attempt count, deferred, or dead-lettered on its own.
//
// A message left without an outcome is not acked: it fails with
// [ErrNoOutcome] and is retried. A non-nil error from HandleBatch means the
// whole batch failed: every message fails with it, whatever outcomes were
// recorded, since a bulk effect that failed may have done none of them.
// Outcomes follow the effects they report: mark a message done only once
// its effect is durable.
//
// HandleBatch must honour ctx, which is cancelled at the handler timeout,
// at the shutdown deadline, and when the delivery of any message of the
// batch is lost while the batch runs; context.Cause then says why. What
// becomes of the lost message and of its batch-mates: see the package
// documentation, section Batches.
type BatchHandler interface {
	HandleBatch(ctx context.Context, b *Batch) error
}

// BatchHandlerFunc adapts an ordinary function to a BatchHandler.
type BatchHandlerFunc func(ctx context.Context, b *Batch) error

// HandleBatch calls f(ctx, b).
func (f BatchHandlerFunc) HandleBatch(ctx context.Context, b *Batch) error { return f(ctx, b) }

// BatchMiddleware wraps a BatchHandler with behaviour of its own, as
// Middleware wraps a Handler.
type BatchMiddleware func(BatchHandler) BatchHandler

// ChainBatch wraps h in mw so that mw[0] is outermost.
func ChainBatch(h BatchHandler, mw ...BatchMiddleware) BatchHandler {
	for i := len(mw) - 1; i >= 0; i-- {
		if mw[i] == nil {
			return brokenBatchChain{}
		}
		h = mw[i](h)
	}
	return h
}

// brokenBatchChain is what ChainBatch returns for a nil middleware;
// consumer.NewBatch refuses it.
type brokenBatchChain struct{}

func (brokenBatchChain) HandleBatch(context.Context, *Batch) error {
	return Unavailable(errors.New("consumer: ChainBatch was given a nil BatchMiddleware"))
}

// ErrNoOutcome is the error of a message its BatchHandler recorded no
// outcome for. The message is retried, as after any failed attempt.
var ErrNoOutcome = errors.New("consumer: the batch handler recorded no outcome for the message (call Batch.Done or Batch.Fail for each message)")

// Batch is the messages one HandleBatch call handles, in the order they
// were received (a lane's messages in the lane's order), and the outcome
// recorded for each. Its methods are safe for concurrent use, so that a
// handler may record outcomes from goroutines of its own.
type Batch struct {
	// Messages are the batch's messages. The handler must not modify the
	// slice.
	Messages []*Message

	mu      sync.Mutex
	index   map[*Message]int // built on first use, but for the runtime's own batches
	results []outcome        // made on first use
}

type outcome struct {
	set bool
	err error
}

// BatchOf returns a batch of msgs with no outcome recorded: for middleware
// that hands a selection of its batch to the next handler, and for tests.
// A Batch literal with its Messages set works as well.
func BatchOf(msgs []*Message) *Batch { return &Batch{Messages: msgs} }

// makeResults makes b's results, one per message, if they are not made;
// called with mu held.
func (b *Batch) makeResults() {
	if b.results == nil {
		b.results = make([]outcome, len(b.Messages))
	}
}

// pos returns m's position in b, or -1, and makes b's results; called with
// mu held.
func (b *Batch) pos(m *Message) int {
	b.makeResults()
	if m != nil && m.batch == b && int(m.batchPos) < len(b.Messages) && b.Messages[m.batchPos] == m {
		return int(m.batchPos) // the runtime's batches record it in the message
	}
	if b.index == nil {
		b.index = make(map[*Message]int, len(b.Messages))
		for i, x := range b.Messages {
			b.index[x] = i
		}
	}
	if i, ok := b.index[m]; ok {
		return i
	}
	return -1
}

// Done records that m's effect is complete: m is acked.
func (b *Batch) Done(m *Message) { b.record(m, nil) }

// Fail records that m's effect failed with err, which may be marked as a
// Handler's error is ([Permanent], [RetryAfter], [Defer], [Unavailable]);
// Fail(m, nil) is Done(m).
func (b *Batch) Fail(m *Message, err error) { b.record(m, err) }

// DoneAll records every message without an outcome as done.
func (b *Batch) DoneAll() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.makeResults()
	for i := range b.results {
		if !b.results[i].set {
			b.results[i] = outcome{set: true}
		}
	}
}

func (b *Batch) record(m *Message, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	i := b.pos(m)
	if i < 0 {
		panic(fmt.Sprintf("consumer: Batch.Done or Batch.Fail for a message (id %q) not in the batch", messageID(m)))
	}
	b.results[i] = outcome{set: true, err: err}
}

// Result returns the outcome recorded for m: its error (nil for done), and
// whether one was recorded at all.
func (b *Batch) Result(m *Message) (err error, ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	i := b.pos(m)
	if i < 0 {
		return nil, false
	}
	return b.results[i].err, b.results[i].set
}

func messageID(m *Message) string {
	if m == nil {
		return ""
	}
	return m.ID
}
