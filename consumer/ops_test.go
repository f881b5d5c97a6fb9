package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// probe asks h for its status code and the status it reports.
func probe(t *testing.T, h http.Handler) (int, consumer.Status) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/", nil))
	var st consumer.Status
	if err := json.Unmarshal(rec.Body.Bytes(), &st); err != nil {
		t.Fatalf("probe answered %q: %v", rec.Body.String(), err)
	}
	return rec.Code, st
}

func TestStatusThroughALife(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	release := make(chan struct{})
	c, err := consumer.New(e.source(), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		<-release
		return nil
	}), consumer.WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	if code, st := probe(t, c.LiveHandler()); code != http.StatusServiceUnavailable || st.State != consumer.StateIdle {
		t.Fatalf("before Run: liveness %d, %+v; want 503, idle", code, st)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	e.publish("m")
	waitFor(t, "the message to run", func() bool { return c.Status().Running == 1 })
	st := c.Status()
	if st.State != consumer.StateRunning || !st.Live || !st.Ready || st.Held != 1 || st.LastReceive.IsZero() {
		t.Fatalf("while running: %+v", st)
	}
	if code, _ := probe(t, c.ReadyHandler()); code != http.StatusOK {
		t.Fatalf("readiness %d while running, want 200", code)
	}
	cancel()
	waitFor(t, "the drain", func() bool { return c.Status().State == consumer.StateDraining })
	if code, st := probe(t, c.ReadyHandler()); code != http.StatusServiceUnavailable || st.Reason != "draining" {
		t.Fatalf("readiness %d (%q) while draining, want 503", code, st.Reason)
	}
	if code, _ := probe(t, c.LiveHandler()); code != http.StatusOK {
		t.Fatalf("liveness %d while draining, want 200", code)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if st := c.Status(); st.State != consumer.StateStopped || st.Live || st.LastAck.IsZero() {
		t.Fatalf("after Run: %+v", st)
	}
}

// Paused, a consumer receives nothing, keeps the leases of what it holds
// alive (nothing is redelivered over three lease periods) and lets it
// finish; resumed, it receives again.
func TestPauseKeepsLeasesAndStopsIntake(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 300 * time.Millisecond})
	e.publish("slow")
	started, release := make(chan struct{}), make(chan struct{})
	var handled atomic.Int32
	c, err := consumer.New(e.source(), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "slow" {
			close(started)
			<-release
		}
		handled.Add(1)
		return nil
	}), consumer.WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	released := false
	defer func() {
		if !released {
			close(release)
		}
		cancel()
		<-done
	}()
	<-started
	c.Pause(consumer.FinishHeld)
	if st := c.Status(); st.State != consumer.StatePaused || !st.Ready {
		t.Fatalf("paused: %+v, want paused and ready", st)
	}
	e.publish("later")
	time.Sleep(time.Second) // three leases
	if s := e.stats("q"); s.Received != 1 || s.Visible != 1 {
		t.Fatalf("while paused: %+v; want the slow message held, not redelivered, and nothing more received", s)
	}
	released = true
	close(release)
	waitFor(t, "the held message to finish", func() bool { return e.stats("q").Acked == 1 })
	c.Resume()
	waitFor(t, "intake to resume", func() bool { return e.stats("q").Acked == 2 })
}

func TestPauseGivesBackWhatWaits(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	for i := range 5 {
		e.publish(strconv.Itoa(i))
	}
	started, release := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	c, err := consumer.New(e.source(), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if first.CompareAndSwap(false, true) {
			close(started)
			<-release
		}
		return nil
	}), consumer.WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	released := false
	defer func() {
		if !released {
			close(release)
		}
		cancel()
		<-done
	}()
	<-started
	waitFor(t, "every message held", func() bool { return e.stats("q").InFlight == 5 })
	c.Pause(consumer.GiveBackWaiting)
	waitFor(t, "the waiting messages given back", func() bool { return e.stats("q").Visible == 4 })
	released = true
	close(release)
	waitFor(t, "the running one acked", func() bool { return e.stats("q").Acked == 1 })
	c.Resume()
	waitFor(t, "the rest after Resume", func() bool { return e.stats("q").Acked == 5 })
}

// A dependency that fails every call trips the kill switch: intake stops,
// nothing is dead-lettered (the held messages wait without using up
// attempts), and once the dependency is back the probes succeed, the switch
// closes and every message is handled.
func TestKillSwitchTripsDeadLettersNothingAndResumes(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	const n = 60
	for i := range n {
		e.publish(strconv.Itoa(i))
	}
	var down atomic.Bool
	down.Store(true)
	c, err := consumer.New(e.source(), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if down.Load() {
			return errors.New("payments API: connection refused")
		}
		return nil
	}), consumer.WithLogger(testlog.New(t)), consumer.WithConcurrency(8), consumer.WithMaxInFlight(40),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(50 * time.Millisecond)}),
		consumer.WithDeadLetter(e.dlq()),
		consumer.WithKillSwitch(consumer.KillSwitch{MinAttempts: 10, Ratio: 0.5, Cooldown: 300 * time.Millisecond, Probes: 2}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitFor(t, "the kill switch to trip", func() bool { k := c.Status().KillSwitch; return k == "open" || k == "half-open" })
	if st := c.Status(); st.Ready || st.State != consumer.StatePaused {
		t.Fatalf("tripped: %+v, want paused and not ready", st)
	}
	received := e.stats("q").Received
	time.Sleep(time.Second) // several cooldowns, probes failing
	if s := e.stats("q"); s.Received > received+int64(n) {
		t.Fatalf("received %d while tripped (from %d)", s.Received, received)
	}
	if d := e.stats("dlq").Visible; d != 0 {
		t.Fatalf("%d dead letters while the dependency was down", d)
	}
	down.Store(false)
	waitFor(t, "every message acked", func() bool { return e.stats("q").Acked == n })
	if d := e.stats("dlq").Visible; d != 0 {
		t.Fatalf("%d dead letters", d)
	}
	if st := c.Status(); st.KillSwitch != "closed" || st.State != consumer.StateRunning {
		t.Fatalf("after recovery: %+v", st)
	}
}

func TestBacklogGaugeMatchesTheBrokersCount(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	for i := range 7 {
		e.publish(strconv.Itoa(i))
	}
	src := e.source()
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error { return nil }),
		consumer.WithLogger(testlog.New(t)), consumer.WithName("backlog"), consumer.WithMeterProvider(mp),
		consumer.WithBacklogInterval(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	c.Pause(consumer.FinishHeld) // the backlog stays as published
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitFor(t, "the first poll", func() bool { return !c.Status().BacklogAt.IsZero() })
	if b := c.Status().Backlog; b.Waiting != 7 || b.InFlight != 0 || b.OldestAge <= 0 {
		t.Fatalf("backlog %+v, want 7 waiting, none in flight, an age", b)
	}
	got := collectAll(t, reader)
	if w := got.points["custody.backlog.waiting"]; w != 7 {
		t.Fatalf("custody.backlog.waiting = %d, want 7", w)
	}
	// Every counter is on the exporter's page before the first message.
	for _, name := range []string{"custody.messages.received", "custody.ack.failures", "custody.deadletter.failures", "custody.lease.lost"} {
		if _, ok := got.points[name]; !ok {
			t.Errorf("%s not exported before the first message", name)
		}
	}
}

// pausingSource is a memory source that fetches ahead on its own, as a
// Kafka source does: it records what the consumer tells it.
type pausingSource struct {
	*memory.Source
	mu     sync.Mutex
	paused bool
}

func (s *pausingSource) Pause()  { s.mu.Lock(); s.paused = true; s.mu.Unlock() }
func (s *pausingSource) Resume() { s.mu.Lock(); s.paused = false; s.mu.Unlock() }
func (s *pausingSource) isPaused() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.paused
}

// A source that fetches ahead stops fetching while either Pause or a
// tripped kill switch holds intake, and fetches again only once neither
// does: the kill switch closing does not undo the caller's Pause, nor
// Resume the switch's.
func TestSourceFetchesOnlyWhileNeitherPauseNorTheKillSwitchHoldsIntake(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	const n = 60
	for i := range n {
		e.publish(strconv.Itoa(i))
	}
	var down atomic.Bool
	down.Store(true)
	src := &pausingSource{Source: e.source()}
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if down.Load() {
			return errors.New("payments API: connection refused")
		}
		return nil
	}), consumer.WithLogger(testlog.New(t)), consumer.WithConcurrency(8), consumer.WithMaxInFlight(40),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(50 * time.Millisecond)}),
		consumer.WithKillSwitch(consumer.KillSwitch{MinAttempts: 10, Ratio: 0.5, Cooldown: 200 * time.Millisecond, Probes: 2}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() { cancel(); <-done }()

	waitFor(t, "the kill switch to trip", func() bool { return c.Status().KillSwitch == "open" })
	if !src.isPaused() {
		t.Fatal("the kill switch tripped and the source was not paused")
	}
	c.Pause(consumer.FinishHeld)
	down.Store(false) // the held messages probe, and the switch closes
	waitFor(t, "the kill switch to close", func() bool { return c.Status().KillSwitch == "closed" })
	if !src.isPaused() {
		t.Fatal("the kill switch closed while the consumer was paused, and the source was resumed")
	}
	c.Resume()
	if src.isPaused() {
		t.Fatal("Resume left the source paused")
	}
	waitFor(t, "every message acked", func() bool { return e.stats("q").Acked == n })
}
