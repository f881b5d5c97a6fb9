// Package soaktest holds what the randomized soaks of the runtime share, whatever
// the broker under them: the bookkeeping of running handler calls that finds
// two live handlers of one message (or of one ordering key), the order in
// which each key's messages are first settled, the violations found, and the
// random handler behaviours. It is for tests only.
package soaktest

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// Rounds runs a soak's rounds as subtests named by their seeds, which follow
// one taken from the clock: def of them, or as many as the environment
// variable prefix_ROUNDS says. prefix_SEED replays the one round of that
// seed (the choices it makes, not the schedule).
func Rounds(t *testing.T, prefix string, def int, round func(t *testing.T, seed uint64)) {
	rounds := def
	if v, err := strconv.Atoi(os.Getenv(prefix + "_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	seed := uint64(time.Now().UnixNano())
	if v, err := strconv.ParseUint(os.Getenv(prefix+"_SEED"), 10, 64); err == nil {
		seed, rounds = v, 1
	}
	for i := range rounds {
		s := seed + uint64(i)
		t.Run(fmt.Sprintf("seed=%d", s), func(t *testing.T) { round(t, s) })
	}
}

// Knobs are the consumer settings a round picks at random.
type Knobs struct {
	Concurrency    int
	InFlight       int // 0: the runtime's default
	MaxAttempts    int
	ByKey          bool          // consumer.OrderByKey
	Leave          bool          // consumer.WithLeaveUnfinishedOnShutdown
	HandlerTimeout time.Duration // 0: none
}

// Options returns the consumer options of k, with the dead-letter
// destination, shutdown timeout and logger given, and a quick constant
// backoff (a broker may round it up: SQS delays by whole seconds).
func (k Knobs) Options(dl adapters.DeadLetter, shutdown time.Duration, logger *slog.Logger) []consumer.Option {
	opts := []consumer.Option{
		consumer.WithConcurrency(k.Concurrency),
		consumer.WithDeadLetter(dl),
		consumer.WithRetry(consumer.Retry{MaxAttempts: k.MaxAttempts, Backoff: consumer.ConstantBackoff(2 * time.Millisecond)}),
		consumer.WithShutdownTimeout(shutdown),
		consumer.WithLogger(logger),
	}
	if k.InFlight > 0 {
		opts = append(opts, consumer.WithMaxInFlight(k.InFlight))
	}
	if k.ByKey {
		opts = append(opts, consumer.WithOrdering(consumer.OrderByKey))
	}
	if k.Leave {
		opts = append(opts, consumer.WithLeaveUnfinishedOnShutdown())
	}
	if k.HandlerTimeout > 0 {
		opts = append(opts, consumer.WithHandlerTimeout(k.HandlerTimeout))
	}
	return opts
}

// Drive runs c, consumer generation gen, and calls stop, which stops it:
// it cancels Run's context with cancel, or makes Run return otherwise (a
// crash of its source). It then checks that Run returns within a
// minute, that it returns nil or an error allowed says is expected, and
// that none of gen's handler calls still runs once it has.
func (l *Log) Drive(gen int, c *consumer.Consumer, stop func(cancel context.CancelFunc), allowed func(error) bool) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	stop(cancel)
	select {
	case err := <-done:
		if err != nil && !allowed(err) {
			l.Violate("consumer %d: Run = %v, want nil after a graceful stop", gen, err)
		}
	case <-time.After(time.Minute):
		l.Violate("consumer %d: Run did not return within a minute of its stop", gen)
		return
	}
	for _, id := range l.StillRunning(gen) {
		l.Violate("consumer %d: the handler of %s still runs after Run returned", gen, id)
	}
}

// Log records one soak round's handler calls and settlements, and the
// violations found. Its methods are safe for concurrent use.
type Log struct {
	grace time.Duration

	checks sync.WaitGroup // overlap checks still waiting

	mu         sync.Mutex
	running    map[string][]*Call // by message ID
	settled    map[string]bool    // message IDs handled successfully or dead-lettered
	firsts     map[string][]int   // key → sequence numbers, in the order first settled
	violations []string
}

// NewLog returns a Log that allows an earlier call grace, once a later call
// it must not overlap has started, to see its context end: the scheduling
// slack of a loaded machine, on top of which the broker's own margin (the
// runtime gives a lease up before it runs out) should suffice.
func NewLog(grace time.Duration) *Log {
	return &Log{
		grace:   grace,
		running: make(map[string][]*Call),
		settled: make(map[string]bool),
		firsts:  make(map[string][]int),
	}
}

// Call is one handler call.
type Call struct {
	Gen int // the consumer (generation) that made it
	ID  string
	Key string
	Ctx context.Context

	// liveAtReturn is set, before returned is closed, when the handler
	// returned with its context alive.
	liveAtReturn bool
	returned     chan struct{}
}

// Start notes that c begins and checks it against the calls running with a
// live context: another call of the same message, or one for which conflicts
// reports true (the same key where the key orders), must see its context
// end within the grace, and before it returns. A call that returns with its
// context alive after a conflicting one began ran live beside it; a call
// cancelled because its lease was lost did not. The returned func must be
// called when the handler returns.
func (l *Log) Start(c *Call, conflicts func(other *Call) bool) (end func()) {
	c.returned = make(chan struct{})
	l.mu.Lock()
	var older []*Call
	for id, calls := range l.running {
		for _, o := range calls {
			if o.Ctx.Err() == nil && (id == c.ID || conflicts(o)) {
				older = append(older, o)
			}
		}
	}
	l.running[c.ID] = append(l.running[c.ID], c)
	l.mu.Unlock()
	for _, o := range older {
		l.checks.Go(func() {
			l.checkOverlap(o, func(what string) {
				l.Violate("message %s (key %s) ran in consumer %d while an earlier call of %s in consumer %d %s with its context alive",
					c.ID, c.Key, c.Gen, o.ID, o.Gen, what)
			})
		})
	}
	return func() {
		c.liveAtReturn = c.Ctx.Err() == nil
		close(c.returned)
		l.mu.Lock()
		defer l.mu.Unlock()
		calls := l.running[c.ID]
		i := slices.Index(calls, c)
		calls = slices.Delete(calls, i, i+1)
		if len(calls) == 0 {
			delete(l.running, c.ID)
		} else {
			l.running[c.ID] = calls
		}
	}
}

// Received notes that the broker handed message id out again, to consumer
// gen. The broker does so only once the lease of the earlier delivery ran
// out, and the runtime gives a lease up, cancelling the handler's context,
// before it runs out: every call of id still running must see its context
// end within the grace, before it returns. Unlike Start, this holds where
// the runtime queues the redelivery behind the running call (its ordering
// key's lane).
func (l *Log) Received(id string, gen int) {
	l.mu.Lock()
	var older []*Call
	for _, o := range l.running[id] {
		if o.Ctx.Err() == nil {
			older = append(older, o)
		}
	}
	l.mu.Unlock()
	for _, o := range older {
		l.checks.Go(func() {
			l.checkOverlap(o, func(what string) {
				l.Violate("message %s was handed out again, to consumer %d, while a call of it in consumer %d %s with its context alive",
					id, gen, o.Gen, what)
			})
		})
	}
}

// checkOverlap calls violate unless o's context, alive when something began
// that o must not overlap, ends within the grace without o returning first.
// (The runtime cancels an attempt's context once it returns, so a context
// ending is not enough.)
func (l *Log) checkOverlap(o *Call, violate func(what string)) {
	t := time.NewTimer(l.grace)
	defer t.Stop()
	select {
	case <-o.Ctx.Done():
	case <-o.returned:
	case <-t.C:
	}
	what := "still ran"
	select {
	case <-o.returned:
		if !o.liveAtReturn {
			return
		}
		what = "returned"
	default:
		if o.Ctx.Err() != nil {
			return
		}
	}
	violate(what)
}

// Wait waits for the overlap checks under way.
func (l *Log) Wait() { l.checks.Wait() }

// Violate records a violation.
func (l *Log) Violate(format string, args ...any) {
	l.mu.Lock()
	l.violations = append(l.violations, fmt.Sprintf(format, args...))
	l.mu.Unlock()
}

// Violations returns the violations recorded so far.
func (l *Log) Violations() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.violations)
}

// StillRunning returns the IDs of the messages whose calls by consumer gen
// have not returned.
func (l *Log) StillRunning(gen int) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var ids []string
	for id, calls := range l.running {
		for _, c := range calls {
			if c.Gen == gen {
				ids = append(ids, id)
			}
		}
	}
	return ids
}

// Settled notes that a handler succeeded for the message, or that it was
// dead-lettered, whichever comes first: the order a key's messages are first
// settled in is the order their effects are seen in. (A message may be
// handled again later: a failed ack brings back a message already settled,
// after its key's later messages.)
func (l *Log) Settled(id, key string, seq int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.settled[id] {
		return
	}
	l.settled[id] = true
	l.firsts[key] = append(l.firsts[key], seq)
}

// Unordered returns, for each key whose messages were first settled out of
// publish (sequence) order, the order they were.
func (l *Log) Unordered() map[string][]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string][]int)
	for key, seqs := range l.firsts {
		if !slices.IsSorted(seqs) {
			out[key] = slices.Clone(seqs)
		}
	}
	return out
}

// Behave acts out a handler call of message seq at attempt, as r (drawn
// uniformly from [0, 1)) picks: it fails (8%), panics (3%), fails
// permanently (2%), asks for a retry after delay (4%), defers for delay
// while attempt < 3 (3%), or, when slow > 0, runs for slow unless ctx ends
// first. Otherwise, or when the slow run ends, it returns nil; but once ctx
// has ended it calls cancelled with ctx's cause and returns that: the caller
// notes a success only on nil.
func Behave(ctx context.Context, seq, attempt int, r float64, slow, delay time.Duration, cancelled func(cause error)) error {
	failure := fmt.Errorf("soak: message %d failed", seq)
	switch {
	case r < 0.08:
		return failure
	case r < 0.11:
		panic(failure)
	case r < 0.13:
		return consumer.Permanent(failure)
	case r < 0.17:
		return consumer.RetryAfter(failure, delay)
	case r < 0.20 && attempt < 3:
		return consumer.Defer(failure, delay)
	case slow > 0:
		t := time.NewTimer(slow)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
		}
	}
	if ctx.Err() != nil {
		cause := context.Cause(ctx)
		cancelled(cause)
		return cause
	}
	return nil
}
