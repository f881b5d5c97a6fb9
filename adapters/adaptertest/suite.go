// Package adaptertest is the conformance suite every custody adapter runs:
// the same behaviours, checked the same way, against each broker. It drives
// the adapter through the real runtime (package consumer), so what it checks
// is what a user gets, and drives Sources directly for what the contract asks
// of each method: among others, that an adapter only translates, and leaves
// timing policy (fetching ahead, renewing leases, batching and retrying acks)
// to the runtime.
//
// The checks named Batch... run the runtime with a batch handler
// (consumer.NewBatch), since a batch holds many deliveries at once, from
// several receives and lanes, and an adapter's per-delivery bookkeeping
// (receipts, delivery tags, offsets, pending entries) must keep each one
// apart: each message of a batch is acked only once its effect is done,
// failed ones come back with their attempt counted, one left without an
// outcome is not acked, and a permanent failure reaches the dead-letter
// destination with its diagnostics while its batch-mates are acked
// (BatchOutcomesPerMessage); a consumer cut off or stopped in the middle of
// a batch loses nothing, and where the Source can be cut off the batch's
// context ends with the loss (BatchCrashLosesNothing); a batch running for
// several leases keeps every message's lease, those waiting behind it too
// (BatchKeepsLeases), and one held past the maximum processing time has its
// context cancelled with adapters.ErrLeaseLost and acks nothing
// (BatchLeaseLostCancelsContext); on an ordered queue, a key's messages
// after a failed one of its batch run again after it, never ahead, other
// keys untouched (BatchOrderPerLane); and a shutdown lets running batches
// finish and gives back the rest, a message waiting in place for its retry
// and its lane included (BatchShutdownDrains).
//
// Every check runs on a queue of its own, in parallel with the others
// (t.Parallel), as many at once as -test.parallel allows: most of their
// time is spent waiting for leases and quiet periods.
//
// An adapter's test fills in a [Harness] and calls [Run]. Tests that need
// something the broker or the harness does not offer (a lease, an ordered
// queue, a way to cut a Source off from the broker) skip with a message
// saying so.
package adaptertest

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// A check is one of the suite's tests, by name.
type check struct {
	name string
	fn   func(*testing.T, Harness)
}

// checks are the suite's tests. They run in parallel with one another
// (each on a queue of its own), as many at once as -test.parallel allows.
var checks = []check{
	{"EffectThenAck", testEffectThenAck},
	{"RedeliveryAfterFailure", testRedeliveryAfterFailure},
	{"RedeliveryAfterCrash", testRedeliveryAfterCrash},
	{"NoConcurrentDuplicateUnderLongHandler", testNoConcurrentDuplicate},
	{"WaitingDeliveriesKeepTheirLease", testWaitingDeliveriesKeepTheirLease},
	{"DeadLetterAfterMaxAttempts", testDeadLetterAfterMaxAttempts},
	{"PermanentErrorDeadLettersAtOnce", testPermanentError},
	{"DeadLetterFailureKeepsOriginal", testDeadLetterFailure},
	{"DeadLetterTakesForeignHeaders", testDeadLetterForeignHeaders},
	{"DeadLetterTakesForeignBodies", testDeadLetterForeignBodies},
	{"DeadLetterTakesOversizedHeader", testDeadLetterOversizedHeader},
	{"DeadLetterReplayedCopyHasFreshDiagnostics", testDeadLetterReplayedCopy},
	{"OrderPerKey", testOrderPerKey},
	{"ShutdownDrains", testShutdownDrains},
	{"ShutdownGivesBackUnfinished", testShutdownGivesBack},
	{"ShutdownKeepsLeasesWhileDraining", testShutdownKeepsLeasesWhileDraining},
	{"LeaseLostCancelsHandler", testLeaseLost},
	{"StaleDeliveryReportsLeaseLost", testStaleDelivery},
	{"CapabilitiesAgreeWithHarness", testCapabilities},
	{"ReceiveBounds", testReceiveBounds},
	{"OrderedDeliveriesNameTheirLanes", testOrderingKeys},
	{"ReceiveAfterContextDone", testReceiveAfterContextDone},
	{"CloseWithReceiveWaiting", testClose},
	{"AckTwice", testAckTwice},
	{"AckAndNackOfOneDelivery", testAckAfterNack},
	{"ForeignDelivery", testForeignDelivery},
	{"NackDelay", testNackDelay},
	{"NoFetchAhead", testNoFetchAhead},
	{"NoSelfRenewal", testNoSelfRenewal},
	{"AckDoesNotLinger", testAckDoesNotLinger},
	{"NackDoesNotLinger", testNackDoesNotLinger},
	{"ExtendDoesNotLinger", testExtendDoesNotLinger},
	{"RefusedEntryIsNotRetried", testRefusedEntryIsNotRetried},
	{"MaxReceive", testMaxReceive},
	{"ConcurrentReceives", testConcurrentReceives},
	{"SignalPerDelivery", testSignalPerDelivery},
}

// batchChecks run the runtime with a batch handler. They run in parallel
// with one another, after the others: each spends most of its time waiting
// for leases and quiet periods, on a queue of its own.
var batchChecks = []check{
	{"BatchOutcomesPerMessage", testBatchOutcomes},
	{"BatchCrashLosesNothing", testBatchCrash},
	{"BatchKeepsLeases", testBatchKeepsLeases},
	{"BatchLeaseLostCancelsContext", testBatchLeaseLost},
	{"BatchOrderPerLane", testBatchOrderPerLane},
	{"BatchShutdownDrains", testBatchShutdownDrains},
}

// checkNamed returns the check called name, or nil.
func checkNamed(name string) func(*testing.T, Harness) {
	for _, c := range append(checks[:len(checks):len(checks)], batchChecks...) {
		if c.name == name {
			return c.fn
		}
	}
	return nil
}

// Run runs the conformance suite.
func Run(t *testing.T, h Harness) {
	t.Helper()
	if h.NewQueue == nil {
		t.Fatal("adaptertest: Harness.NewQueue is nil")
	}
	for name := range h.Pending {
		if checkNamed(name) == nil {
			t.Fatalf("adaptertest: Harness.Pending names %q, which is not a check of the suite", name)
		}
	}
	for _, tc := range checks {
		t.Run(tc.name, func(t *testing.T) {
			if why, ok := h.Pending[tc.name]; ok {
				t.Skip("pending: " + why)
			}
			t.Parallel()
			tc.fn(t, h)
		})
	}
	for _, tc := range batchChecks {
		t.Run(tc.name, func(t *testing.T) {
			if why, ok := h.Pending[tc.name]; ok {
				t.Skip("pending: " + why)
			}
			t.Parallel()
			tc.fn(t, h)
		})
	}
}

// patience bounds every wait for something that should happen. Waits poll;
// nothing fails for being slow short of this.
const patience = 60 * time.Second

func fastRetry(max int) consumer.Option {
	return consumer.WithRetry(consumer.Retry{MaxAttempts: max, Backoff: consumer.ConstantBackoff(20 * time.Millisecond)})
}

// quietPeriod is how long the suite watches for a redelivery that must not
// come: past a lease where there is one.
func quietPeriod(q *Queue) time.Duration {
	if q.Lease > 0 {
		return 2*q.Lease + 500*time.Millisecond
	}
	return 1500 * time.Millisecond
}

func publishN(t *testing.T, q *Queue, n int, key string) []string {
	t.Helper()
	bodies := make([]string, n)
	msgs := make([]Message, n)
	for i := range msgs {
		bodies[i] = fmt.Sprintf("%s-%d", t.Name(), i)
		msgs[i] = Message{Key: key, Body: []byte(bodies[i])}
	}
	publish(t, q, msgs...)
	return bodies
}

// publish puts msgs on q, bounded by patience.
func publish(t *testing.T, q *Queue, msgs ...Message) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := q.Publish(ctx, msgs...); err != nil {
		t.Fatalf("publish: %v", err)
	}
}

// started is a consumer running in the background.
type started struct {
	t      *testing.T
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	err    error
}

func start(t *testing.T, src adapters.Source, h consumer.Handler, opts ...consumer.Option) *started {
	t.Helper()
	opts = append([]consumer.Option{consumer.WithLogger(testlog.New(t))}, opts...)
	c, err := consumer.New(src, h, opts...)
	if err != nil {
		t.Fatalf("consumer.New: %v", err)
	}
	return launch(t, c)
}

// launch runs c in the background until the test ends or stop is called.
func launch(t *testing.T, c *consumer.Consumer) *started {
	ctx, cancel := context.WithCancel(context.Background())
	s := &started{t: t, cancel: cancel, done: make(chan error, 1)}
	go func() { s.done <- c.Run(ctx) }()
	t.Cleanup(func() { s.stop() })
	return s
}

// stop cancels Run and waits for it to return.
func (s *started) stop() error {
	s.once.Do(func() {
		s.cancel()
		select {
		case s.err = <-s.done:
		case <-time.After(patience):
			s.t.Errorf("Run did not return within %v of cancellation", patience)
		}
	})
	return s.err
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(patience)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", patience, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// recorder counts handler calls per body.
type recorder struct {
	mu       sync.Mutex
	calls    map[string]int
	attempts map[string][]int
	order    []string
}

func newRecorder() *recorder {
	return &recorder{calls: map[string]int{}, attempts: map[string][]int{}}
}

func (r *recorder) record(m *consumer.Message) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	b := string(m.Body)
	r.calls[b]++
	r.attempts[b] = append(r.attempts[b], m.Attempt)
	r.order = append(r.order, b)
	return r.calls[b]
}

func (r *recorder) count(body string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls[body]
}

func (r *recorder) distinct() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.calls)
}

func (r *recorder) total() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.order)
}

// expectNothingMore runs a fresh consumer on q for a quiet period and fails
// if it receives anything: what was acked must not come back. The quiet
// period starts once the consumer handled a marker published for it, so a
// consumer slow to start (a Kafka one joining its group) cannot make the
// check pass unseen.
func expectNothingMore(t *testing.T, q *Queue) {
	t.Helper()
	expectFates(t, q, nil)
}

func testEffectThenAck(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: 2 * time.Second})
	bodies := publishN(t, q, 20, "")
	rec := newRecorder()
	var effects sync.Map
	s := start(t, q.Open(t), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		effects.Store(string(m.Body), true)
		rec.record(m)
		return nil
	}), consumer.WithConcurrency(4))
	waitFor(t, "all messages handled", func() bool { return rec.distinct() == len(bodies) })
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	for _, b := range bodies {
		if _, ok := effects.Load(b); !ok {
			t.Errorf("message %q acked without its effect", b)
		}
		if n := rec.count(b); n != 1 {
			t.Errorf("message %q handled %d times, want 1", b, n)
		}
	}
	expectNothingMore(t, q)
}

func testRedeliveryAfterFailure(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: 2 * time.Second})
	bodies := publishN(t, q, 5, "")
	rec := newRecorder()
	s := start(t, q.Open(t), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if rec.record(m) == 1 {
			return errors.New("first attempt fails")
		}
		return nil
	}), consumer.WithConcurrency(2), fastRetry(5))
	waitFor(t, "every message handled twice", func() bool {
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
	rec.mu.Lock()
	for _, b := range bodies {
		if got := rec.attempts[b]; len(got) != 2 || got[0] != 1 || got[1] != 2 {
			t.Errorf("message %q attempts = %v, want [1 2]", b, got)
		}
	}
	rec.mu.Unlock()
	expectNothingMore(t, q)
}

func testRedeliveryAfterCrash(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: time.Second})
	bodies := publishN(t, q, 10, "")
	// A consumer takes messages and dies before acking any of them.
	src := q.Open(t)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	var held []string
	for len(held) == 0 && ctx.Err() == nil {
		ds, err := src.Receive(ctx, len(bodies))
		if err != nil {
			t.Fatalf("Receive: %v", err)
		}
		for _, d := range ds {
			held = append(held, string(d.Body))
		}
	}
	took := len(held)
	counts := src.Capabilities().CountsDeliveries
	if err := src.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	rec := newRecorder()
	s := start(t, q.Open(t), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		rec.record(m)
		return nil
	}), consumer.WithConcurrency(4))
	waitFor(t, "every message handled after the crash", func() bool { return rec.distinct() == len(bodies) })
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	t.Logf("the crashed consumer held %d of %d messages; all %d were handled afterwards", took, len(bodies), rec.distinct())
	if counts {
		// The broker counts deliveries (CountsDeliveries), so the count must
		// survive the crash: MaxAttempts depends on it for a message that
		// kills every consumer that takes it.
		rec.mu.Lock()
		defer rec.mu.Unlock()
		for _, b := range held {
			if got := rec.attempts[b]; len(got) == 0 || got[0] < 2 {
				t.Errorf("message %q, received by the crashed consumer, came back with attempts %v, want the first >= 2", b, got)
			}
		}
	}
}

func testNoConcurrentDuplicate(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: time.Second})
	if q.Lease <= 0 {
		t.Skip("the broker does not lease deliveries")
	}
	bodies := publishN(t, q, 2, "")
	var (
		mu      sync.Mutex
		running = map[string]int{}
		overlap []string
	)
	rec := newRecorder()
	h1 := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		b := string(m.Body)
		mu.Lock()
		running[b]++
		if running[b] > 1 {
			overlap = append(overlap, b)
		}
		mu.Unlock()
		defer func() { mu.Lock(); running[b]--; mu.Unlock() }()
		rec.record(m)
		select {
		case <-time.After(3 * q.Lease):
			return nil
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	})
	// Two consumers compete for the same queue: a lease that ran out would
	// hand the message to the other one while the first still works on it.
	a := start(t, q.Open(t), h1, consumer.WithConcurrency(2))
	b := start(t, q.Open(t), h1, consumer.WithConcurrency(2))
	waitFor(t, "both messages handled", func() bool { return rec.distinct() == len(bodies) })
	time.Sleep(3*q.Lease + 500*time.Millisecond)
	a.stop()
	b.stop()
	mu.Lock()
	defer mu.Unlock()
	if len(overlap) > 0 {
		t.Fatalf("messages ran concurrently with themselves: %v", overlap)
	}
	for _, body := range bodies {
		if n := rec.count(body); n != 1 {
			t.Errorf("message %q handled %d times, want 1: its lease was not kept alive", body, n)
		}
	}
}

// deadLettered polls the dead-letter destination until it holds want
// messages, and returns them by body.
func deadLettered(t *testing.T, q *Queue, want int) map[string]Message {
	t.Helper()
	got := map[string]Message{}
	waitFor(t, fmt.Sprintf("%d messages in the dead-letter destination", want), func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), patience)
		defer cancel()
		ms, err := q.DeadLettered(ctx)
		if err != nil {
			t.Fatalf("DeadLettered: %v", err)
		}
		seen := map[string]bool{}
		for _, m := range ms {
			// One read never holds a message twice (DeadLettered returns
			// what arrived so far, or consumes it): a second copy is a
			// message dead-lettered twice.
			if seen[string(m.Body)] {
				t.Fatalf("message %q is in the dead-letter destination twice", m.Body)
			}
			seen[string(m.Body)] = true
			got[string(m.Body)] = m
		}
		return len(got) >= want
	})
	return got
}

func testDeadLetterAfterMaxAttempts(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: 2 * time.Second})
	good := publishN(t, q, 3, "")
	ctx := context.Background()
	poison := "poison-" + t.Name()
	if err := q.Publish(ctx, Message{Body: []byte(poison), Headers: map[string]string{"origin": "suite"}}); err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	before := time.Now()
	var (
		srcMu  sync.Mutex
		source *consumer.Message // the poison message as the handler saw it
	)
	s := start(t, q.Open(t), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		rec.record(m)
		if string(m.Body) == poison {
			srcMu.Lock()
			source = m
			srcMu.Unlock()
			return errors.New("cannot process " + poison)
		}
		return nil
	}), consumer.WithConcurrency(2), fastRetry(3), consumer.WithDeadLetter(q.DeadLetter))
	dl := deadLettered(t, q, 1)
	waitFor(t, "good messages handled", func() bool { return rec.distinct() == len(good)+1 })
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	m, ok := dl[poison]
	if !ok || len(dl) != 1 {
		t.Fatalf("dead-letter destination holds %v, want only the poison message", keys(dl))
	}
	if n := rec.count(poison); n != 3 {
		t.Errorf("poison message handled %d times, want MaxAttempts=3", n)
	}
	checkDiagnostics(t, m, "3", "false", "cannot process", before)
	srcMu.Lock()
	checkSource(t, m, source)
	srcMu.Unlock()
	if m.Headers["origin"] != "suite" {
		t.Errorf("original header lost in the dead-letter copy: %v", m.Headers)
	}
	for _, b := range good {
		if rec.count(b) != 1 {
			t.Errorf("good message %q handled %d times; the poison message must not disturb it", b, rec.count(b))
		}
	}
	expectNothingMore(t, q)
}

func checkDiagnostics(t *testing.T, m Message, attempts, permanent, errText string, before time.Time) {
	t.Helper()
	hd := m.Headers
	if hd[adapters.HeaderAttempts] != attempts {
		t.Errorf("%s = %q, want %s (headers %v)", adapters.HeaderAttempts, hd[adapters.HeaderAttempts], attempts, hd)
	}
	if hd[adapters.HeaderPermanent] != permanent {
		t.Errorf("%s = %q, want %s", adapters.HeaderPermanent, hd[adapters.HeaderPermanent], permanent)
	}
	if !strings.Contains(hd[adapters.HeaderError], errText) {
		t.Errorf("%s = %q, want it to contain %q", adapters.HeaderError, hd[adapters.HeaderError], errText)
	}
	if hd[adapters.HeaderOriginalQueue] == "" {
		t.Errorf("%s missing", adapters.HeaderOriginalQueue)
	}
	first, err1 := time.Parse(time.RFC3339Nano, hd[adapters.HeaderFirstFailure])
	last, err2 := time.Parse(time.RFC3339Nano, hd[adapters.HeaderLastFailure])
	if err1 != nil || err2 != nil {
		t.Errorf("failure times missing or malformed: first %q, last %q", hd[adapters.HeaderFirstFailure], hd[adapters.HeaderLastFailure])
		return
	}
	if last.Before(first) || first.Before(before.Add(-time.Minute)) || last.After(time.Now().Add(time.Minute)) {
		t.Errorf("failure times out of order or range: first %v, last %v", first, last)
	}
}

// checkSource checks that the dead-letter copy m names where the original
// came from: its queue or topic, and its partition and offset where it has
// them.
func checkSource(t *testing.T, m Message, orig *consumer.Message) {
	t.Helper()
	hd := m.Headers
	if hd[adapters.HeaderOriginalQueue] != orig.Queue {
		t.Errorf("%s = %q, want %q", adapters.HeaderOriginalQueue, hd[adapters.HeaderOriginalQueue], orig.Queue)
	}
	if orig.Partition < 0 || orig.Offset < 0 {
		return
	}
	wantPart, wantOff := strconv.FormatInt(int64(orig.Partition), 10), strconv.FormatInt(orig.Offset, 10)
	if hd[adapters.HeaderOriginalPart] != wantPart || hd[adapters.HeaderOriginalOffset] != wantOff {
		t.Errorf("%s/%s = %q/%q, want %s/%s", adapters.HeaderOriginalPart, adapters.HeaderOriginalOffset,
			hd[adapters.HeaderOriginalPart], hd[adapters.HeaderOriginalOffset], wantPart, wantOff)
	}
}

func keys(m map[string]Message) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}

func testPermanentError(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: 2 * time.Second})
	bodies := publishN(t, q, 1, "")
	rec := newRecorder()
	before := time.Now()
	s := start(t, q.Open(t), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		rec.record(m)
		return consumer.Permanent(errors.New("malformed payload"))
	}), fastRetry(5), consumer.WithDeadLetter(q.DeadLetter))
	dl := deadLettered(t, q, 1)
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n := rec.count(bodies[0]); n != 1 {
		t.Errorf("permanently failing message handled %d times, want 1", n)
	}
	checkDiagnostics(t, dl[bodies[0]], "1", "true", "malformed payload", before)
	expectNothingMore(t, q)
}

// failingDeadLetter refuses writes until allowed.
type failingDeadLetter struct {
	next  adapters.DeadLetter
	mu    sync.Mutex
	fails int
	open  bool
}

func (f *failingDeadLetter) Send(ctx context.Context, d *adapters.Delivery, fl adapters.Failure) error {
	f.mu.Lock()
	if !f.open {
		f.fails++
		f.mu.Unlock()
		return errors.New("dead-letter destination unavailable")
	}
	f.mu.Unlock()
	return f.next.Send(ctx, d, fl)
}

func (f *failingDeadLetter) failures() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fails
}

func testDeadLetterFailure(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: 2 * time.Second})
	bodies := publishN(t, q, 1, "")
	fdl := &failingDeadLetter{next: q.DeadLetter}
	s := start(t, q.Open(t), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return consumer.Permanent(errors.New("rejected"))
	}), fastRetry(2), consumer.WithDeadLetter(fdl))
	waitFor(t, "two failed dead-letter writes", func() bool { return fdl.failures() >= 2 })
	// The original must still be there: open the destination and it arrives.
	fdl.mu.Lock()
	fdl.open = true
	fdl.mu.Unlock()
	dl := deadLettered(t, q, 1)
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if _, ok := dl[bodies[0]]; !ok {
		t.Fatalf("after failed dead-letter writes the message was lost; destination holds %v", keys(dl))
	}
}

func testOrderPerKey(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: 2 * time.Second, Ordered: true})
	const perKey = 15
	keysList := []string{"a", "b", "c"}
	var msgs []Message
	for i := 0; i < perKey; i++ {
		for _, k := range keysList {
			msgs = append(msgs, Message{Key: k, Body: []byte(k + "-" + strconv.Itoa(i))})
		}
	}
	if err := q.Publish(context.Background(), msgs...); err != nil {
		t.Fatal(err)
	}
	var (
		mu      sync.Mutex
		seen    = map[string][]int{}
		running = map[string]bool{}
		bad     []string
	)
	total := 0
	s := start(t, q.Open(t), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		k, n, _ := strings.Cut(string(m.Body), "-")
		i, _ := strconv.Atoi(n)
		mu.Lock()
		if running[k] {
			bad = append(bad, "concurrent "+string(m.Body))
		}
		running[k] = true
		mu.Unlock()
		time.Sleep(time.Millisecond)
		mu.Lock()
		running[k] = false
		if i == 3 && len(seen[k]) == 3 && k == "b" {
			// One failure in the middle of a lane: the retry must come
			// before anything later in the same key.
			seen[k] = append(seen[k], -1)
			mu.Unlock()
			return errors.New("transient")
		}
		if len(seen[k]) > 0 && seen[k][len(seen[k])-1] == -1 {
			seen[k] = seen[k][:len(seen[k])-1]
		}
		seen[k] = append(seen[k], i)
		total++
		mu.Unlock()
		return nil
	}), consumer.WithConcurrency(8), fastRetry(5))
	waitFor(t, "all ordered messages handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return total >= len(msgs)
	})
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(bad) > 0 {
		t.Fatalf("same-key messages ran concurrently: %v", bad)
	}
	for _, k := range keysList {
		for i, got := range seen[k] {
			if got != i {
				t.Fatalf("key %s handled out of order: %v", k, seen[k])
			}
		}
	}
}

func testShutdownDrains(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: 2 * time.Second})
	bodies := publishN(t, q, 4, "")
	var (
		mu       sync.Mutex
		started  = map[string]bool{}
		finished = map[string]bool{}
		release  = make(chan struct{})
	)
	s := start(t, q.Open(t), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		started[string(m.Body)] = true
		mu.Unlock()
		<-release
		select {
		case <-time.After(200 * time.Millisecond):
		case <-ctx.Done():
			return context.Cause(ctx) // the drain must not cut the handler short
		}
		mu.Lock()
		finished[string(m.Body)] = true
		mu.Unlock()
		return nil
	}), consumer.WithConcurrency(len(bodies)), consumer.WithShutdownTimeout(patience))
	waitFor(t, "all handlers running", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(started) == len(bodies)
	})
	stopped := make(chan error, 1)
	go func() { stopped <- s.stop() }()
	time.Sleep(50 * time.Millisecond) // let the shutdown begin while handlers run
	close(release)
	if err := <-stopped; err != nil {
		t.Fatalf("Run: %v", err)
	}
	mu.Lock()
	n := len(finished)
	mu.Unlock()
	if n != len(bodies) {
		t.Fatalf("%d of %d in-flight handlers finished before Run returned", n, len(bodies))
	}
	expectNothingMore(t, q)
}

func testLeaseLost(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: time.Second})
	if q.Lease <= 0 {
		t.Skip("the broker does not lease deliveries; adapter tests cover its own ways of losing a delivery")
	}
	bodies := publishN(t, q, 1, "")
	causes := make(chan error, 4)
	rec := newRecorder()
	s := start(t, q.Open(t), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if rec.record(m) > 1 {
			return nil
		}
		<-ctx.Done()
		causes <- context.Cause(ctx)
		return context.Cause(ctx)
	}), consumer.WithMaxProcessingTime(q.Lease+q.Lease/2), fastRetry(5))
	select {
	case cause := <-causes:
		if !errors.Is(cause, adapters.ErrLeaseLost) {
			t.Fatalf("handler context cancelled with %v, want a cause wrapping adapters.ErrLeaseLost", cause)
		}
	case <-time.After(patience):
		t.Fatal("the handler's context was not cancelled when its lease could no longer be kept")
	}
	waitFor(t, "the message delivered again", func() bool { return rec.count(bodies[0]) >= 2 })
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
}

// testShutdownGivesBack checks the other half of the drain: handlers that do
// not finish by the shutdown timeout, and deliveries still waiting for a
// worker, are given back to the broker, neither acked nor lost.
func testShutdownGivesBack(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: 2 * time.Second})
	bodies := publishN(t, q, 6, "")
	first := newRecorder()
	s := start(t, q.Open(t), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		first.record(m)
		<-ctx.Done() // runs until the shutdown timeout cuts it short
		return context.Cause(ctx)
	}), consumer.WithConcurrency(2), consumer.WithShutdownTimeout(100*time.Millisecond))
	waitFor(t, "two handlers running", func() bool { return first.total() >= 2 })
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	rec := newRecorder()
	s2 := start(t, q.Open(t), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		rec.record(m)
		return nil
	}), consumer.WithConcurrency(4))
	waitFor(t, "every unfinished message handled by the next consumer", func() bool { return rec.distinct() == len(bodies) })
	if err := s2.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	t.Logf("the first consumer started %d handlers; all %d messages came back", first.total(), rec.distinct())
}

// testStaleDelivery checks that an adapter tells a lost lease apart from
// other failures: once another consumer received the message after the
// lease ran out, and acked it, renewing the first delivery fails with
// adapters.ErrLeaseLost. LeaseLostCancelsHandler alone does not show this:
// there the runtime's own cap (WithMaxProcessingTime) ends the lease.
func testStaleDelivery(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: time.Second})
	if q.Lease <= 0 {
		t.Skip("the broker does not lease deliveries; adapter tests cover its own ways of losing a delivery")
	}
	bodies := publishN(t, q, 1, "")
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	receiveOne := func(src adapters.Source) *adapters.Delivery {
		t.Helper()
		for ctx.Err() == nil {
			ds, err := src.Receive(ctx, 1)
			if err != nil {
				t.Fatalf("Receive: %v", err)
			}
			if len(ds) > 0 {
				if len(ds) != 1 || string(ds[0].Body) != bodies[0] {
					t.Fatalf("received %d deliveries, want the one message", len(ds))
				}
				return ds[0]
			}
		}
		t.Fatalf("no delivery within %v", patience)
		return nil
	}
	a, b := q.Open(t), q.Open(t)
	defer a.Close()
	defer b.Close()
	stale := receiveOne(a) // never renewed: its lease runs out
	fresh := receiveOne(b)
	if err := b.Ack(ctx, []*adapters.Delivery{fresh}); err != nil {
		t.Fatalf("Ack of the fresh delivery: %v", err)
	}
	ext, ok := a.(adapters.Extender)
	if !ok {
		t.Fatalf("%T leases deliveries but does not implement adapters.Extender", a)
	}
	err := ext.Extend(ctx, []*adapters.Delivery{stale}, q.Lease)
	if e := adapters.EntryError(err, 0); !errors.Is(e, adapters.ErrLeaseLost) {
		t.Fatalf("renewing a delivery whose message another consumer received and acked: %v, want an error wrapping adapters.ErrLeaseLost", err)
	}
	expectNothingMore(t, q)
}
