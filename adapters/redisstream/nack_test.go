package redisstream

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// retryAcrossProcesses has a first consumer fail a message with
// RetryAfter(delay) and stop, and a second consumer (another process, as
// far as Redis knows) take it: the retry must wait in Redis, survive the
// first consumer, come back no sooner than delay after the failure, and as
// attempt 2. While it waits the first consumer, with one worker, handles
// other messages: the retry holds no worker.
func retryAcrossProcesses(t *testing.T, lease, delay time.Duration) {
	e := newEnv(t)
	e.publish("retry", "x0", "x1", "x2", "x3")
	var (
		mu       sync.Mutex
		failedAt time.Time
		others   int
	)
	srcA := e.open(WithLease(lease), WithReclaimInterval(20*time.Millisecond))
	a := start(t, srcA, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if string(m.Body) == "retry" {
			failedAt = time.Now()
			return consumer.RetryAfter(errors.New("not yet"), delay)
		}
		others++
		return nil
	}), consumer.WithConcurrency(1))
	waitFor(t, "the others handled while the retry waits", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return others == 4 && !failedAt.IsZero()
	})
	if err := a.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	mu.Lock()
	waited := time.Since(failedAt)
	mu.Unlock()
	if waited >= delay {
		t.Fatalf("the first consumer took %v to handle the other messages and stop, longer than the retry delay %v; the test proves nothing", waited, delay)
	}

	type back struct {
		at      time.Time
		attempt int
	}
	got := make(chan back, 4)
	srcB := e.open(WithLease(lease), WithReclaimInterval(20*time.Millisecond))
	b := start(t, srcB, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		got <- back{time.Now(), m.Attempt}
		return nil
	}))
	var r back
	select {
	case r = <-got:
	case <-time.After(time.Minute):
		t.Fatal("the retry never came back")
	}
	waitFor(t, "the retry acked", func() bool { return len(e.pending()) == 0 })
	if err := b.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	mu.Lock()
	after := r.at.Sub(failedAt)
	mu.Unlock()
	if after < delay {
		t.Errorf("the retry came back %v after the failure, want no sooner than %v", after, delay)
	}
	if r.attempt != 2 {
		t.Errorf("the retry came back as attempt %d, want 2", r.attempt)
	}
	if len(got) > 0 {
		t.Errorf("the retry was handled more than once")
	}
	t.Logf("retry delay %v (lease %v): came back after %v, attempt %d", delay, lease, after, r.attempt)
}

// A delay within the lease: the idle time is set to lease - delay.
func TestRetrySurvivesTheProcess(t *testing.T) {
	retryAcrossProcesses(t, 2*time.Second, 800*time.Millisecond)
}

// A delay of several leases: the entry is parked, and claimed and set aside
// again at each reclaim until it is due, without its delivery count growing.
func TestLongRetrySurvivesTheProcess(t *testing.T) {
	retryAcrossProcesses(t, 200*time.Millisecond, 1200*time.Millisecond)
}

// TestNackDelayPerEntry gives back two entries in one call, one at once and
// one after a minute: the first must come back at the next receive, the
// second must stay with its delay (idle time well short of the lease).
func TestNackDelayPerEntry(t *testing.T) {
	const lease = 2 * time.Minute
	e := newEnv(t)
	ids := e.publish("now", "later")
	src := e.open(WithLease(lease))
	defer src.Close()
	ds := receiveN(t, src, 2)
	err := src.Nack(e.ctx(), []adapters.Nack{{Delivery: ds[0], After: 0}, {Delivery: ds[1], After: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	back := receiveN(t, src, 1)
	if back[0].ID != ids[0] || back[0].Attempt != 2 {
		t.Fatalf("came back: %s attempt %d, want %s attempt 2", back[0].ID, back[0].Attempt, ids[0])
	}
	for _, p := range e.pending() {
		if p.ID == ids[1] && p.Idle >= lease-time.Minute+10*time.Second {
			t.Errorf("the entry given back for a minute is idle %v: due within %v, not a minute", p.Idle, lease-p.Idle)
		}
	}
	ds, err = src.Receive(e.ctx(), 10)
	if err != nil || len(ds) != 0 {
		t.Errorf("Receive after the first came back: %d entries, %v; want none: the other waits a minute", len(ds), err)
	}
}
