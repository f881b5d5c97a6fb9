package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
)

// recallSource is a memory source whose test can recall the deliveries it
// handed out, as the Kafka adapter does on a revoke. It reports no recalls
// to the runtime (it is no adapters.Recaller): the runtime finds them when
// it reaches the jobs.
type recallSource struct {
	*nackRecorder
	mu    sync.Mutex
	first map[string]*adapters.Delivery // each body's first delivery
}

func (s *recallSource) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	ds, err := s.nackRecorder.Receive(ctx, max)
	s.mu.Lock()
	for _, d := range ds {
		if _, ok := s.first[string(d.Body)]; !ok {
			s.first[string(d.Body)] = d
		}
	}
	s.mu.Unlock()
	return ds, err
}

func (s *recallSource) received(bodies ...string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, b := range bodies {
		if s.first[b] == nil {
			return false
		}
	}
	return true
}

// recall recalls the first deliveries of bodies, in the order given.
func (s *recallSource) recall(bodies ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, b := range bodies {
		s.first[b].Signal.Recall()
	}
}

// recallerSource is a recallSource that tells the runtime of its recalls
// (adapters.Recaller).
type recallerSource struct {
	*recallSource
	recalls chan struct{}
}

func (s *recallerSource) Recalls() <-chan struct{} { return s.recalls }

func (s *recallerSource) recall(bodies ...string) {
	s.recallSource.recall(bodies...)
	select {
	case s.recalls <- struct{}{}:
	default:
	}
}

// newRecallEnv publishes bodies to a queue "q", FIFO with group "a" or not,
// and returns a recallSource on it.
func newRecallEnv(t *testing.T, fifo bool, bodies ...string) (*memory.Broker, *recallSource) {
	t.Helper()
	msgs := make([]memory.Message, len(bodies))
	for i, body := range bodies {
		msgs[i] = memory.Message{Body: []byte(body)}
		if fifo {
			msgs[i].Key = "a"
		}
	}
	return newRecallQueue(t, memory.QueueOptions{Lease: 2 * time.Second, FIFO: fifo}, msgs...)
}

// newRecallQueue publishes msgs to a queue "q" made with opts and returns a
// recallSource on it.
func newRecallQueue(t *testing.T, opts memory.QueueOptions, msgs ...memory.Message) (*memory.Broker, *recallSource) {
	t.Helper()
	b := memory.NewBroker()
	if err := b.CreateQueue("q", opts); err != nil {
		t.Fatal(err)
	}
	if err := b.Publish(context.Background(), "q", msgs...); err != nil {
		t.Fatal(err)
	}
	mem, err := b.Source("q", memory.WithPollWait(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	return b, &recallSource{nackRecorder: &nackRecorder{Source: mem}, first: map[string]*adapters.Delivery{}}
}

// reporting wraps s as a source that tells the runtime of its recalls.
func reporting(s *recallSource) *recallerSource {
	return &recallerSource{recallSource: s, recalls: make(chan struct{}, 1)}
}

// slowFirst is a handler whose first delivery of slow blocks until release
// is closed, and which records every effect in order.
type slowFirst struct {
	slow      string
	started   chan struct{}
	release   chan struct{}
	cancelled atomic.Bool

	mu   sync.Mutex
	done []string
}

func newSlowFirst(slow string) *slowFirst {
	return &slowFirst{slow: slow, started: make(chan struct{}), release: make(chan struct{})}
}

func (h *slowFirst) handle(ctx context.Context, m *consumer.Message) error {
	if string(m.Body) == h.slow && m.Attempt == 1 {
		close(h.started)
		select {
		case <-h.release:
		case <-ctx.Done():
			h.cancelled.Store(true)
			return ctx.Err()
		}
	}
	h.mu.Lock()
	h.done = append(h.done, string(m.Body))
	h.mu.Unlock()
	return nil
}

func (h *slowFirst) effects() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.done)
}

func acked(t *testing.T, b *memory.Broker, n int) func() bool {
	return func() bool {
		s, err := b.Stats("q")
		if err != nil {
			t.Fatal(err)
		}
		return s.Acked == int64(n)
	}
}

// Recalled deliveries queued behind a running one of their lane are given
// back when the runtime reaches them, without running their handler; the
// running one is not disturbed (its context stays alive) and its ack
// counts; the lane's effects still happen in order once the given-back
// messages come again.
func TestRecallGivesBackQueuedJobsAndSparesTheRunningOne(t *testing.T) {
	all := []string{"a1", "a2", "a3", "a4", "a5"}
	b, src := newRecallEnv(t, true, all...)
	h := newSlowFirst("a1")
	r := runOn(t, src, h.handle, consumer.WithConcurrency(4))
	defer r.stop()
	await(t, "a1's handler to start", h.started)
	waitFor(t, "the whole group to be received", func() bool { return src.received(all...) })
	src.recall("a5", "a4", "a3", "a2", "a1") // the latest first; a1 is running
	if got := h.effects(); len(got) != 0 {
		t.Fatalf("effects %v before a1 was released", got)
	}
	close(h.release)
	waitFor(t, "every message acked", acked(t, b, len(all)))
	if h.cancelled.Load() {
		t.Error("the running handler's context was cancelled by a recall")
	}
	bodies, delays := src.nacked()
	if !slices.Equal(bodies[:min(4, len(bodies))], []string{"a2", "a3", "a4", "a5"}) {
		t.Errorf("nacked %v, want a2..a5 given back in order", bodies)
	}
	for i, d := range delays {
		if d != 0 {
			t.Errorf("nack %d of %s asked for a %v delay, want 0", i, bodies[i], d)
		}
	}
	if got := h.effects(); !slices.Equal(got, all) {
		t.Errorf("effects %v, want %v: each once, in order", got, all)
	}
}

// With a source that reports its recalls (adapters.Recaller), the recalled
// jobs queued behind a running one of their lane are given back at once,
// while it still runs, not when it ends.
func TestRecallerGivesBackQueuedJobsWhileTheLanesJobRuns(t *testing.T) {
	all := []string{"a1", "a2", "a3", "a4", "a5"}
	b, inner := newRecallEnv(t, true, all...)
	src := reporting(inner)
	h := newSlowFirst("a1")
	r := runOn(t, src, h.handle, consumer.WithConcurrency(4))
	defer r.stop()
	await(t, "a1's handler to start", h.started)
	waitFor(t, "the whole group to be received", func() bool { return inner.received(all...) })
	src.recall("a5", "a4", "a3", "a2", "a1")
	waitFor(t, "a2..a5 to be given back while a1 runs", func() bool {
		bodies, _ := inner.nacked()
		return len(bodies) == 4
	})
	if bodies, _ := inner.nacked(); !slices.Equal(bodies, []string{"a2", "a3", "a4", "a5"}) {
		t.Fatalf("nacked %v, want a2..a5 in order", bodies)
	}
	if got := h.effects(); len(got) != 0 {
		t.Fatalf("effects %v before a1 was released", got)
	}
	close(h.release)
	waitFor(t, "every message acked", acked(t, b, len(all)))
	if h.cancelled.Load() {
		t.Error("the running handler's context was cancelled by a recall")
	}
	if got := h.effects(); !slices.Equal(got, all) {
		t.Errorf("effects %v, want %v: each once, in order", got, all)
	}
}

// Unordered jobs waiting for a worker (all of them busy) are given back at
// once when recalled, with a source that reports its recalls.
func TestRecallerGivesBackJobsWaitingForAWorker(t *testing.T) {
	all := []string{"m1", "m2", "m3", "m4"}
	b, inner := newRecallEnv(t, false, all...)
	src := reporting(inner)
	h := newSlowFirst("m1")
	r := runOn(t, src, h.handle, consumer.WithConcurrency(1))
	defer r.stop()
	await(t, "m1's handler to start", h.started)
	waitFor(t, "every message to be received", func() bool { return inner.received(all...) })
	src.recall("m2", "m3", "m4")
	waitFor(t, "m2..m4 to be given back while m1 runs", func() bool {
		bodies, _ := inner.nacked()
		return len(bodies) >= 3
	})
	if bodies, _ := inner.nacked(); !slices.Equal(slices.Sorted(slices.Values(bodies)), []string{"m2", "m3", "m4"}) {
		t.Fatalf("nacked %v, want m2, m3 and m4", bodies)
	}
	if got := h.effects(); len(got) != 0 {
		t.Fatalf("effects %v before m1 was released", got)
	}
	close(h.release)
	waitFor(t, "every message acked", acked(t, b, len(all)))
	if got := h.effects(); len(got) != len(all) {
		t.Errorf("effects %v, want each of %v once", got, all)
	}
}

// A delivery recalled while a retry of it waits in place for its backoff
// (an hour here) is given back at once: no handler runs meanwhile. The lane
// goes on, and its effects happen in order.
func TestRecallEndsARetryWaitingInPlace(t *testing.T) {
	b, src := newRecallEnv(t, true, "a1", "a2")
	failed := make(chan struct{})
	var mu sync.Mutex
	var done []string
	h := func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "a1" && m.Attempt == 1 {
			close(failed)
			return errors.New("not yet")
		}
		mu.Lock()
		done = append(done, fmt.Sprintf("%s#%d", m.Body, m.Attempt))
		mu.Unlock()
		return nil
	}
	r := runOn(t, src, h, consumer.WithConcurrency(2),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 5, Backoff: consumer.ConstantBackoff(time.Hour)}))
	defer r.stop()
	await(t, "a1's first attempt to fail", failed)
	waitFor(t, "a1 and a2 to be received", func() bool { return src.received("a1", "a2") })
	src.recall("a2", "a1")
	waitFor(t, "both messages acked", acked(t, b, 2))
	bodies, delays := src.nacked()
	if !slices.Equal(bodies, []string{"a1", "a2"}) || !slices.Equal(delays, []time.Duration{0, 0}) {
		t.Errorf("nacked %v with delays %v, want a1 and a2 given back at once", bodies, delays)
	}
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(done, []string{"a1#2", "a2#2"}) {
		t.Errorf("effects %v, want a1 then a2, each redelivered once", done)
	}
}

// lateRecallSource hands out its first delivery alone, and every later one
// already recalled, signalling the recall before handing it out: the
// deliveries an adapter recalls between handing them out and the runtime
// queueing them, which the runtime's scan for that signal finds nowhere.
type lateRecallSource struct {
	*nackRecorder
	recalls chan struct{}
	calls   atomic.Int32
}

func (s *lateRecallSource) Recalls() <-chan struct{} { return s.recalls }

func (s *lateRecallSource) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	call := s.calls.Add(1)
	if call == 1 {
		return s.nackRecorder.Receive(ctx, 1)
	}
	ds, err := s.nackRecorder.Receive(ctx, max)
	if call > 2 || len(ds) == 0 {
		return ds, err // the redeliveries are not recalled
	}
	for _, d := range ds {
		d.Signal.Recall()
	}
	select {
	case s.recalls <- struct{}{}:
	default:
	}
	time.Sleep(10 * time.Millisecond) // let the scan run, and miss them
	return ds, err
}

// Deliveries found recalled when the runtime accepts them are given back at
// once, even with every worker busy: the source's signal came before they
// were queued, so its scan could not find them.
func TestRecalledOnArrivalAreGivenBackWhileWorkersAreBusy(t *testing.T) {
	all := []string{"m1", "m2", "m3", "m4"}
	b, inner := newRecallEnv(t, false, all...)
	src := &lateRecallSource{nackRecorder: inner.nackRecorder, recalls: make(chan struct{}, 1)}
	h := newSlowFirst("m1")
	r := runOn(t, src, h.handle, consumer.WithConcurrency(1))
	defer r.stop()
	await(t, "m1's handler to start", h.started)
	waitFor(t, "m2..m4 to be given back while m1 runs", func() bool {
		bodies, _ := inner.nacked()
		return len(bodies) >= 3
	})
	if got := h.effects(); len(got) != 0 {
		t.Fatalf("effects %v before m1 was released", got)
	}
	close(h.release)
	waitFor(t, "every message acked", acked(t, b, len(all)))
}

// A recalled delivery whose running handler the shutdown deadline cuts short
// is given back, even with WithLeaveUnfinishedOnShutdown: the adapter that
// recalled it (a Kafka revoke) waits for it, and left to its lease it would
// hold that wait up until the end.
func TestRecalledDeliveryCutAtShutdownIsGivenBackNotLeft(t *testing.T) {
	_, src := newRecallEnv(t, false, "m1")
	started := make(chan struct{})
	r := runOn(t, src, func(ctx context.Context, m *consumer.Message) error {
		close(started)
		<-ctx.Done()
		return ctx.Err()
	}, consumer.WithLeaveUnfinishedOnShutdown(), consumer.WithShutdownTimeout(50*time.Millisecond))
	await(t, "the handler to start", started)
	waitFor(t, "m1 to be received", func() bool { return src.received("m1") })
	src.recall("m1")
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if bodies, _ := src.nacked(); !slices.Equal(bodies, []string{"m1"}) {
		t.Fatalf("nacked %v, want m1 given back rather than left to its lease", bodies)
	}
}

// An OrderByKey lane can hold deliveries of several of the source's ordered
// streams (the records of one key in two Kafka partitions, with the adapter's
// ordering Unordered). A recalled delivery of one stream waiting in such a
// lane behind a job of another stream, which is not recalled and may hold
// the lane for long (a retry waiting out an hour's backoff here), is given
// back at once, not once that job is done: the adapter (a revoke) waits for
// it. Here x0, x1 and y1 share key k; y1 alone is recalled, as a revoke of
// its partition would.
func TestRecallerGivesBackKeyLaneJobBehindAnotherStreamsJob(t *testing.T) {
	all := []string{"x0", "x1", "y1"}
	var msgs []memory.Message
	for _, body := range all {
		msgs = append(msgs, memory.Message{Body: []byte(body), Key: "k"})
	}
	_, inner := newRecallQueue(t, memory.QueueOptions{Lease: 2 * time.Second}, msgs...)
	src := reporting(inner)
	started, release, failed := make(chan struct{}), make(chan struct{}), make(chan struct{})
	h := func(ctx context.Context, m *consumer.Message) error {
		switch {
		case string(m.Body) == "x0" && m.Attempt == 1:
			close(started)
			<-release
		case string(m.Body) == "x1" && m.Attempt == 1:
			close(failed)
			return errors.New("not yet")
		}
		return nil
	}
	r := runOn(t, src, h, consumer.WithConcurrency(4), consumer.WithOrdering(consumer.OrderByKey),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 5, Backoff: consumer.ConstantBackoff(time.Hour)}))
	defer r.stop()
	await(t, "x0's handler to start", started)
	waitFor(t, "every message to be received", func() bool { return inner.received(all...) })
	close(release) // x0 ends: x1, then y1, are next in the lane
	await(t, "x1's first attempt to fail", failed)
	src.recall("y1")
	waitFor(t, "y1 to be given back while x1 waits for its retry", func() bool {
		bodies, _ := inner.nacked()
		return slices.Contains(bodies, "y1")
	})
}

// A recalled lane head that waits in the workers' queue (every worker busy
// with another job) is given back at once with the recalled jobs queued
// behind it in its lane, in the lane's order, while the busy worker's job
// runs on.
func TestRecallerGivesBackALaneHeadWaitingForAWorker(t *testing.T) {
	msgs := []memory.Message{{Body: []byte("m1")}} // keyless: no lane, runs first
	for _, body := range []string{"b1", "b2", "b3"} {
		msgs = append(msgs, memory.Message{Body: []byte(body), Key: "b"})
	}
	b, inner := newRecallQueue(t, memory.QueueOptions{Lease: 2 * time.Second}, msgs...)
	src := reporting(inner)
	h := newSlowFirst("m1")
	r := runOn(t, src, h.handle, consumer.WithConcurrency(1), consumer.WithOrdering(consumer.OrderByKey))
	defer r.stop()
	await(t, "m1's handler to start", h.started)
	waitFor(t, "every message to be received", func() bool { return inner.received("b1", "b2", "b3") })
	src.recall("b3", "b2", "b1") // the latest first, as the Kafka adapter does
	waitFor(t, "b1..b3 to be given back while m1 runs", func() bool {
		bodies, _ := inner.nacked()
		return len(bodies) == 3
	})
	if bodies, _ := inner.nacked(); !slices.Equal(bodies, []string{"b1", "b2", "b3"}) {
		t.Fatalf("nacked %v, want b1, b2, b3: the lane's order", bodies)
	}
	if got := h.effects(); len(got) != 0 {
		t.Fatalf("effects %v before m1 was released", got)
	}
	close(h.release)
	waitFor(t, "every message acked", acked(t, b, len(msgs)))
	if got := h.effects(); !slices.Equal(got, []string{"m1", "b1", "b2", "b3"}) {
		t.Errorf("effects %v, want m1, b1, b2, b3: each once, the lane in order", got)
	}
}

// A recalled delivery still waiting for a worker when shutdown begins is
// given back, even with WithLeaveUnfinishedOnShutdown: the adapter that
// recalled it waits for it. The source here reports no recalls, so nothing
// gave m2 back before the drain reached it; m1, running and not recalled,
// is left to its lease as the option asks.
func TestRecalledJobWaitingAtShutdownIsGivenBackNotLeft(t *testing.T) {
	_, src := newRecallEnv(t, false, "m1", "m2")
	h := newSlowFirst("m1") // never released: the shutdown timeout cuts it
	r := runOn(t, src, h.handle, consumer.WithConcurrency(1),
		consumer.WithLeaveUnfinishedOnShutdown(), consumer.WithShutdownTimeout(50*time.Millisecond))
	await(t, "m1's handler to start", h.started)
	waitFor(t, "m2 to be received", func() bool { return src.received("m2") })
	src.recall("m2")
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if bodies, _ := src.nacked(); !slices.Equal(bodies, []string{"m2"}) {
		t.Fatalf("nacked %v, want m2 given back and m1 left to its lease", bodies)
	}
	if got := h.effects(); len(got) != 0 {
		t.Errorf("effects %v: a recalled delivery ran at shutdown", got)
	}
}

// A delivery that is lost and then recalled while it waits for a worker (a
// revoke that the adapter both reports and recalls) is settled as lost, as
// process settles it, not given back: the adapter refuses to take back what
// it lost, and a release would count a delivery the consumer never had back
// to give.
func TestRecallOfALostWaitingDeliveryIsSettledLost(t *testing.T) {
	reader, mp := newMeter()
	// A lease long enough that m2 comes back only after the test.
	b, inner := newRecallQueue(t, memory.QueueOptions{Lease: time.Minute},
		memory.Message{Body: []byte("m1")}, memory.Message{Body: []byte("m2")})
	src := reporting(inner)
	h := newSlowFirst("m1")
	r := runOn(t, src, h.handle, consumer.WithConcurrency(1), consumer.WithName("recall"), consumer.WithMeterProvider(mp))
	await(t, "m1's handler to start", h.started)
	waitFor(t, "m2 to be received", func() bool { return inner.received("m2") })
	inner.mu.Lock()
	m2 := inner.first["m2"]
	inner.mu.Unlock()
	m2.Signal.Lose(adapters.ErrRevoked)
	src.recall("m2")
	waitFor(t, "the runtime to take the recall signal", func() bool { return len(src.recalls) == 0 })
	close(h.release)
	waitFor(t, "m1 acked", func() bool {
		s, err := b.Stats("q")
		return err == nil && s.Acked >= 1
	})
	c := stopAndCollect(t, r, reader, "recall")
	if bodies, _ := inner.nacked(); len(bodies) != 0 {
		t.Errorf("nacked %v, want nothing: m2 was lost before it was recalled", bodies)
	}
	c.want(map[string]int64{
		"custody.messages.settled/lost":     1,
		"custody.messages.settled/released": 0,
	})
}

// hangingRenewals is a recallerSource whose lease renewals hang, once one
// includes the delivery of body target, until unblock is closed: a renewal
// stuck on the wire.
type hangingRenewals struct {
	*recallerSource
	target  string
	hung    chan struct{}
	once    sync.Once
	unblock chan struct{}
}

func (s *hangingRenewals) Extend(ctx context.Context, ds []*adapters.Delivery, d time.Duration) error {
	for _, x := range ds {
		if string(x.Body) == s.target {
			s.once.Do(func() { close(s.hung) })
			<-s.unblock
			break
		}
	}
	return s.recallerSource.Extend(ctx, ds, d)
}

// Giving back recalled jobs queued in a lane waits for their leases'
// renewals on the wire to end, and that wait holds no other lane up: a
// worker that finishes a job of another lane passes that lane on meanwhile.
func TestRecallWaitingForARenewalHoldsNoOtherLaneUp(t *testing.T) {
	msgs := []memory.Message{{Body: []byte("a1"), Key: "a"}, {Body: []byte("a2"), Key: "a"}, {Body: []byte("a3"), Key: "a"}}
	b, inner := newRecallQueue(t, memory.QueueOptions{Lease: 900 * time.Millisecond, FIFO: true}, msgs...)
	src := &hangingRenewals{recallerSource: reporting(inner), target: "a2", hung: make(chan struct{}), unblock: make(chan struct{})}
	started := map[string]chan struct{}{"a1": make(chan struct{}), "b1": make(chan struct{})}
	release := map[string]chan struct{}{"a1": make(chan struct{}), "b1": make(chan struct{})}
	var mu sync.Mutex
	var effects []string
	h := func(ctx context.Context, m *consumer.Message) error {
		body := string(m.Body)
		if ch, ok := started[body]; ok && m.Attempt == 1 {
			close(ch)
			select {
			case <-release[body]:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		mu.Lock()
		effects = append(effects, body)
		mu.Unlock()
		return nil
	}
	r := runOn(t, src, h, consumer.WithConcurrency(4))
	defer r.stop()
	defer close(release["a1"])
	defer close(src.unblock)
	await(t, "a1's handler to start", started["a1"])
	waitFor(t, "group a to be received", func() bool { return inner.received("a1", "a2", "a3") })
	await(t, "the renewal of group a's leases to hang", src.hung)
	// Group b arrives after that renewal began, so its leases are not in it.
	if err := b.Publish(context.Background(), "q", memory.Message{Body: []byte("b1"), Key: "b"},
		memory.Message{Body: []byte("b2"), Key: "b"}); err != nil {
		t.Fatal(err)
	}
	await(t, "b1's handler to start", started["b1"])
	waitFor(t, "b2 to be received", func() bool { return inner.received("b2") })
	src.recall("a3", "a2")
	time.Sleep(20 * time.Millisecond) // let the give-back reach the hung renewal
	close(release["b1"])
	waitFor(t, "b2 to run while the recalled jobs' renewal hangs", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return slices.Contains(effects, "b2")
	})
	if bodies, _ := inner.nacked(); len(bodies) != 0 {
		t.Errorf("nacked %v while their leases' renewal was on the wire", bodies)
	}
}
