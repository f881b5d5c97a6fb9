package adaptertest

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// The tests in this file run the runtime with a batch handler
// (consumer.NewBatch) over the adapter, and check what its user sees: each
// message of a batch keeps its own fate (acked once its effect is done,
// retried with its own attempt count, dead-lettered on its own), its own
// lease, and its lane's order; a batch cut short by a crash or a lost
// delivery loses nothing; a batch running at shutdown finishes. A batch
// holds many deliveries at once, from several lanes and receives, which is
// where an adapter's per-delivery bookkeeping (receipts, tags, offsets,
// pending entries) is put to the test.

// batchLinger is how long the suite's batches wait to fill: long enough to
// gather what the first receives bring, short next to every wait.
const batchLinger = 100 * time.Millisecond

// startBatch runs a batch consumer on src in the background.
func startBatch(t *testing.T, src adapters.Source, h consumer.BatchHandlerFunc, opts ...consumer.Option) *started {
	t.Helper()
	opts = append([]consumer.Option{consumer.WithLogger(testlog.New(t)), consumer.WithBatchLinger(batchLinger)}, opts...)
	c, err := consumer.NewBatch(src, h, opts...)
	if err != nil {
		t.Fatalf("consumer.NewBatch: %v", err)
	}
	return launch(t, c)
}

// isLoss reports whether err says a delivery was lost, as the runtime
// reports it in a handler's context's cause.
func isLoss(err error) bool {
	for _, lost := range []error{adapters.ErrLeaseLost, adapters.ErrConnectionLost, adapters.ErrRevoked, adapters.ErrClosed} {
		if errors.Is(err, lost) {
			return true
		}
	}
	return false
}

// testBatchOutcomes runs batches in which the handler records some
// messages done, fails some once, leaves one without an outcome, and fails
// one permanently, while the dead-letter destination refuses its first
// write. Each message keeps its own fate. A message is acked only once its
// effect is done: the ones failed once, and the one left without an
// outcome, come back with their attempt counted (2 on their second
// attempt). The permanent failure reaches the dead-letter destination once,
// with its diagnostics, after the refused write (the original kept
// meanwhile, its handler not run again). The done ones, the dead-lettered
// one included, never come back.
func testBatchOutcomes(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: time.Second})
	bodies := publishN(t, q, 9, "")
	poison := "poison-" + t.Name()
	publish(t, q, Message{Body: []byte(poison), Headers: map[string]string{"origin": "suite"}})
	failing := map[string]bool{bodies[1]: true, bodies[4]: true, bodies[7]: true}
	forgotten := bodies[5]
	rec := newRecorder()
	fdl := &failingDeadLetter{next: q.DeadLetter}
	var (
		mu      sync.Mutex
		effects = map[string]int{}
		source  *consumer.Message // the poison message as the handler saw it
		batched int               // the size of the poison message's batch
	)
	before := time.Now()
	s := startBatch(t, q.Open(t), func(ctx context.Context, b *consumer.Batch) error {
		for _, m := range b.Messages {
			body := string(m.Body)
			first := rec.record(m) == 1
			switch {
			case body == poison:
				mu.Lock()
				source, batched = m, len(b.Messages)
				mu.Unlock()
				b.Fail(m, consumer.Permanent(errors.New("malformed payload in a batch")))
			case first && failing[body]:
				b.Fail(m, errors.New("first attempt fails"))
			case first && body == forgotten:
				// No outcome: the message must not be acked.
			default:
				mu.Lock()
				effects[body]++ // the effect, before the outcome that reports it
				mu.Unlock()
				b.Done(m)
			}
		}
		return nil
	}, consumer.WithBatchSize(len(bodies)+1), fastRetry(5), consumer.WithDeadLetter(fdl))
	waitFor(t, "a refused dead-letter write", func() bool { return fdl.failures() >= 1 })
	fdl.mu.Lock()
	fdl.open = true
	fdl.mu.Unlock()
	dl := deadLettered(t, q, 1)
	waitFor(t, "every message's effect done", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(effects) == len(bodies)
	})
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	rec.mu.Lock()
	for _, b := range bodies {
		want := "[1]"
		if failing[b] || b == forgotten {
			want = "[1 2]"
		}
		if got := fmt.Sprint(rec.attempts[b]); got != want {
			t.Errorf("message %q ran as attempts %s, want %s", b, got, want)
		}
	}
	if n := rec.calls[poison]; n != 1 {
		t.Errorf("the permanently failing message was handled %d times, want once: a refused dead-letter write keeps the original and tries the write again", n)
	}
	rec.mu.Unlock()
	mu.Lock()
	for _, b := range bodies {
		if effects[b] != 1 {
			t.Errorf("message %q had its effect done %d times, want once", b, effects[b])
		}
	}
	m, ok := dl[poison]
	if !ok || len(dl) != 1 {
		t.Fatalf("dead-letter destination holds %v, want only the poison message", keys(dl))
	}
	checkDiagnostics(t, m, "1", "true", "malformed payload", before)
	checkSource(t, m, source)
	if m.Headers["origin"] != "suite" {
		t.Errorf("original header lost in the dead-letter copy: %v", m.Headers)
	}
	t.Logf("the poison message was handled in a batch of %d", batched)
	mu.Unlock()
	expectNothingMore(t, q)
}

// testBatchCrash stops a consumer abruptly in the middle of a batch whose
// handler has recorded half of its messages done and not returned. Where
// the harness can cut the Source off from the broker (Queue.Crash), it
// does, and the batch's context must end with the loss of its deliveries
// (the Source can neither renew nor settle them). Otherwise the consumer is
// stopped and the batch cut at the shutdown deadline. Either way nothing is
// lost: a second consumer receives every message, the ones recorded done
// included, since their batch never finished.
func testBatchCrash(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: time.Second})
	bodies := publishN(t, q, 6, "")
	inBatch := make(chan int, 1)
	causes := make(chan error, 1)
	// Cut off, the Source's deliveries are lost within a lease or so, which
	// the shutdown deadline must not beat; otherwise the deadline is the cut.
	deadline := 200 * time.Millisecond
	if q.Crash != nil {
		deadline = patience
	}
	srcA := q.Open(t)
	a := startBatch(t, srcA, func(ctx context.Context, b *consumer.Batch) error {
		for i, m := range b.Messages {
			if i < (len(b.Messages)+1)/2 {
				b.Done(m) // recorded, but the batch never finishes
			}
		}
		select {
		case inBatch <- len(b.Messages):
		default:
		}
		<-ctx.Done()
		select {
		case causes <- context.Cause(ctx):
		default:
		}
		return context.Cause(ctx)
	}, consumer.WithConcurrency(1), consumer.WithBatchSize(len(bodies)), consumer.WithShutdownTimeout(deadline))
	select {
	case n := <-inBatch:
		t.Logf("a batch of %d running", n)
	case <-time.After(patience):
		t.Fatalf("no batch started within %v", patience)
	}
	if q.Crash != nil {
		q.Crash(srcA)
		select {
		case cause := <-causes:
			if !isLoss(cause) {
				t.Errorf("the batch of a Source cut off from the broker ended with %v, want the loss of its deliveries (adapters.ErrLeaseLost, ErrConnectionLost, ErrRevoked or ErrClosed)", cause)
			}
		case <-time.After(patience):
			t.Errorf("the batch's context did not end within %v of its Source being cut off from the broker: its deliveries can no longer be kept", patience)
		}
	} else {
		t.Log("the harness cannot cut a Source off (Queue.Crash is nil): the batch is cut at the shutdown deadline")
	}
	_ = a.stop() // a crashed Source may fail to close
	rec := newRecorder()
	s := start(t, q.Open(t), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		rec.record(m)
		return nil
	}), consumer.WithConcurrency(4))
	waitFor(t, "every message received by the next consumer", func() bool { return rec.distinct() == len(bodies) })
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
}

// testBatchKeepsLeases runs a batch for three leases while a second
// consumer watches the queue: every message of the batch, and every one
// waiting behind it, must keep its lease, so that each is handled once (on
// its first delivery, where the broker counts deliveries).
func testBatchKeepsLeases(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: time.Second})
	if q.Lease <= 0 {
		t.Skip("the broker does not lease deliveries")
	}
	bodies := publishN(t, q, 6, "")
	rec := newRecorder()
	var slow, slowDone atomic.Bool
	handler := func(ctx context.Context, b *consumer.Batch) error {
		for _, m := range b.Messages {
			rec.record(m)
		}
		if slow.CompareAndSwap(false, true) {
			select {
			case <-time.After(3 * q.Lease):
			case <-ctx.Done():
				return context.Cause(ctx)
			}
			slowDone.Store(true)
		}
		b.DoneAll()
		return nil
	}
	srcA := q.Open(t)
	counts := srcA.Capabilities().CountsDeliveries
	// Room for every message, and one worker: what the first batch does
	// not take waits behind it, held.
	a := startBatch(t, srcA, handler, consumer.WithConcurrency(1), consumer.WithBatchSize(len(bodies)/2), consumer.WithMaxInFlight(2*len(bodies)))
	waitFor(t, "the first batch running", func() bool { return rec.total() >= 1 })
	b := startBatch(t, q.Open(t), handler, consumer.WithBatchSize(len(bodies)))
	waitFor(t, "every message handled and the long batch done", func() bool {
		return slowDone.Load() && rec.distinct() == len(bodies)
	})
	stopAndExpectOnce(t, rec, bodies, counts, "while a batch held it", a, b)
}

// testBatchLeaseLost holds a batch past the maximum processing time, as
// LeaseLostCancelsHandler holds a message: the runtime stops renewing its
// messages' leases and loses them. The batch's context must be cancelled
// with a cause wrapping adapters.ErrLeaseLost, no message of the batch may
// be acked (the handler returns that cause), and every one comes back.
func testBatchLeaseLost(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: time.Second})
	if q.Lease <= 0 {
		t.Skip("the broker does not lease deliveries; adapter tests cover its own ways of losing a delivery, and BatchCrash a lost connection")
	}
	bodies := publishN(t, q, 3, "")
	causes := make(chan error, 1)
	rec := newRecorder()
	s := startBatch(t, q.Open(t), func(ctx context.Context, b *consumer.Batch) error {
		again := true
		for _, m := range b.Messages {
			if rec.record(m) == 1 {
				again = false
			}
		}
		if again {
			b.DoneAll()
			return nil
		}
		<-ctx.Done()
		select {
		case causes <- context.Cause(ctx):
		default:
		}
		return context.Cause(ctx)
	}, consumer.WithBatchSize(len(bodies)), consumer.WithMaxProcessingTime(q.Lease+q.Lease/2), fastRetry(5))
	select {
	case cause := <-causes:
		if !errors.Is(cause, adapters.ErrLeaseLost) {
			t.Fatalf("the batch's context was cancelled with %v, want a cause wrapping adapters.ErrLeaseLost", cause)
		}
	case <-time.After(patience):
		t.Fatal("the batch's context was not cancelled when its leases could no longer be kept")
	}
	waitFor(t, "every message of the batch delivered again", func() bool {
		for _, b := range bodies {
			if rec.count(b) < 2 {
				return false
			}
		}
		return true
	})
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
}

// testBatchOrderPerLane runs batches on an ordered queue with three keys,
// with a handler that records every message done but the second of key b,
// which fails once. The messages of key b after it that shared its batch
// must not be acked ahead of it: they run again after its retry, so that
// the last successful run of key b's messages is in order. Keys a and c
// are handled once each, in order; no key's messages run in two batches at
// once.
func testBatchOrderPerLane(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: time.Second, Ordered: true})
	const perKey = 6
	keyList := []string{"a", "b", "c"}
	var msgs []Message
	for i := range perKey {
		for _, k := range keyList {
			msgs = append(msgs, Message{Key: k, Body: []byte(k + "-" + strconv.Itoa(i))})
		}
	}
	publish(t, q, msgs...)
	var (
		mu       sync.Mutex
		done     = map[string][]int{} // per key, the messages recorded done, in order
		doneSet  = map[string]bool{}
		runs     = map[string]int{}
		running  = map[string]bool{}
		bad      []string
		failed   bool
		failMate []string // key b's messages after the failed one in its batch
	)
	s := startBatch(t, q.Open(t), func(ctx context.Context, b *consumer.Batch) error {
		mu.Lock()
		lanes := map[string]bool{}
		for _, m := range b.Messages {
			k, _, _ := strings.Cut(string(m.Body), "-")
			lanes[k] = true
		}
		for k := range lanes {
			if running[k] {
				bad = append(bad, "key "+k+" in two batches at once")
			}
			running[k] = true
		}
		mu.Unlock()
		time.Sleep(time.Millisecond)
		mu.Lock()
		defer mu.Unlock()
		failedHere := false
		for _, m := range b.Messages {
			body := string(m.Body)
			k, n, _ := strings.Cut(body, "-")
			i, _ := strconv.Atoi(n)
			runs[body]++
			if k == "b" && i == 1 && !failed {
				failed, failedHere = true, true
				b.Fail(m, errors.New("transient"))
				continue
			}
			if failedHere && k == "b" {
				failMate = append(failMate, body)
			}
			done[k] = append(done[k], i)
			doneSet[body] = true
			b.Done(m)
		}
		for k := range lanes {
			running[k] = false
		}
		return nil
	}, consumer.WithBatchSize(10), fastRetry(5))
	// The messages after the failed one in its batch run again after it;
	// stopping before they have would give them back unrun, not show order.
	waitFor(t, "every message recorded done, and key b's rerun", func() bool {
		mu.Lock()
		defer mu.Unlock()
		if len(doneSet) != len(msgs) || runs["b-1"] < 2 {
			return false
		}
		for _, body := range failMate {
			if runs[body] < 2 {
				return false
			}
		}
		return true
	})
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(bad) > 0 {
		t.Fatalf("one key's messages ran concurrently: %v", bad)
	}
	for _, k := range keyList {
		if got := lastRunOrder(done[k]); !sort.IntsAreSorted(got) {
			t.Errorf("key %s: its messages' last successful runs came in the order %v (all runs: %v): a message was settled ahead of an earlier one", k, got, done[k])
		}
	}
	for _, body := range failMate {
		if runs[body] < 2 {
			t.Errorf("message %q, after the failed one of its key in its batch, ran %d times: it was acked ahead of the failed one", body, runs[body])
		}
	}
	if runs["b-1"] != 2 {
		t.Errorf("the failed message ran %d times, want twice", runs["b-1"])
	}
	for _, k := range []string{"a", "c"} {
		for i := range perKey {
			if body := k + "-" + strconv.Itoa(i); runs[body] != 1 {
				t.Errorf("message %q of a key without failures ran %d times, want once", body, runs[body])
			}
		}
	}
	t.Logf("key b's messages after the failed one in its batch, run again after it: %v", failMate)
}

// lastRunOrder returns the messages of runs (message indexes, in the order
// they ran) in the order of their last run.
func lastRunOrder(runs []int) []int {
	last := map[int]int{}
	for pos, i := range runs {
		last[i] = pos
	}
	order := make([]int, 0, len(last))
	for i := range last {
		order = append(order, i)
	}
	sort.Slice(order, func(x, y int) bool { return last[order[x]] < last[order[y]] })
	return order
}

// testBatchShutdownDrains begins the shutdown while batches run, with
// messages waiting behind them. The consumer orders by key, so where the
// adapter carries keys the messages wait in their lanes, and the first
// message of key b fails, asking for a retry in an hour: it waits in
// place, its lane behind it. The running batches must finish with their
// contexts alive and what they recorded done be acked (but a keyed message
// behind a failed one of its key in its batch); everything else is given
// back at once, the message waiting for its retry and its lane included,
// and Run returns: a fresh consumer receives exactly what was not acked.
func testBatchShutdownDrains(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: time.Second})
	var msgs []Message
	for i := range 4 {
		for _, k := range []string{"a", "b"} {
			msgs = append(msgs, Message{Key: k, Body: []byte(fmt.Sprintf("%s-%s-%d", t.Name(), k, i))})
		}
	}
	publish(t, q, msgs...)
	failing := fmt.Sprintf("%s-b-0", t.Name())
	var (
		mu      sync.Mutex
		batches int
		acked   = map[string]bool{}
		failed  bool
		cut     []error
	)
	release := make(chan struct{})
	s := startBatch(t, q.Open(t), func(ctx context.Context, b *consumer.Batch) error {
		mu.Lock()
		batches++
		behind := map[string]bool{} // keys with a failed message earlier in the batch
		for _, m := range b.Messages {
			body := string(m.Body)
			if body == failing && m.Key != "" && !failed {
				failed, behind[m.Key] = true, true
				b.Fail(m, consumer.RetryAfter(errors.New("retried in an hour"), time.Hour))
				continue
			}
			b.Done(m)
			if m.Key == "" || !behind[m.Key] {
				acked[body] = true
			}
		}
		waits := len(behind) == 0 // the batch that failed a message returns at once
		mu.Unlock()
		if !waits {
			return nil
		}
		<-release
		select {
		case <-time.After(200 * time.Millisecond):
			return nil
		case <-ctx.Done():
			mu.Lock()
			cut = append(cut, context.Cause(ctx))
			mu.Unlock()
			return context.Cause(ctx) // the drain must not cut a batch short
		}
	}, consumer.WithConcurrency(2), consumer.WithBatchSize(2), consumer.WithOrdering(consumer.OrderByKey),
		consumer.WithShutdownTimeout(patience))
	waitFor(t, "two batches started", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return batches >= 2
	})
	time.Sleep(50 * time.Millisecond) // let a batch that failed a message settle it
	stopped := make(chan error, 1)
	go func() { stopped <- s.stop() }()
	time.Sleep(50 * time.Millisecond) // let the shutdown begin while the batches run
	close(release)
	if err := <-stopped; err != nil {
		t.Fatalf("Run: %v", err)
	}
	mu.Lock()
	if len(cut) > 0 {
		t.Errorf("the shutdown cut running batches short (%v): it must let them finish", cut)
	}
	fates := map[string]bool{}
	for _, m := range msgs {
		fates[string(m.Body)] = acked[string(m.Body)]
	}
	t.Logf("acked before Run returned: %v; a keyed message waited for its retry: %v", acked, failed)
	mu.Unlock()
	expectFates(t, q, fates)
}
