package redisstream

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// receiveN calls src.Receive until it holds n deliveries.
func receiveN(t testing.TB, src *Source, n int) []*adapters.Delivery {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var got []*adapters.Delivery
	for len(got) < n {
		ds, err := src.Receive(ctx, n-len(got))
		if err != nil {
			t.Fatalf("Receive: %v", err)
		}
		got = append(got, ds...)
	}
	return got
}

// TestRenewalNeverTakesBackAClaimedEntry lets a held entry go idle past the
// lease, has another consumer claim it, and then renews it from the first:
// the renewal must fail with adapters.ErrLeaseLost and leave the entry with
// the consumer that claimed it. A renewal by plain XCLAIM (to itself, min
// idle 0) would take it back, and the two would run it at once.
func TestRenewalNeverTakesBackAClaimedEntry(t *testing.T) {
	const lease = 200 * time.Millisecond
	e := newEnv(t)
	e.publish("one")
	a := e.open(WithLease(lease))
	defer a.Close()
	b := e.open(WithLease(lease), WithReclaimInterval(10*time.Millisecond))
	defer b.Close()
	stale := receiveN(t, a, 1)[0]
	fresh := receiveN(t, b, 1)[0] // claimed once idle for the lease
	if fresh.ID != stale.ID || fresh.Attempt != 2 {
		t.Fatalf("the second consumer got %s attempt %d, want %s attempt 2", fresh.ID, fresh.Attempt, stale.ID)
	}
	err := a.Extend(e.ctx(), []*adapters.Delivery{stale}, lease)
	if e := adapters.EntryError(err, 0); !errors.Is(e, adapters.ErrLeaseLost) {
		t.Fatalf("renewing an entry another consumer claimed: %v, want an error wrapping adapters.ErrLeaseLost", err)
	}
	p := e.pending()
	if len(p) != 1 || p[0].Consumer != b.Consumer() {
		t.Fatalf("pending after the refused renewal: %+v, want the entry with %s", p, b.Consumer())
	}
	// Nor may a give-back take it: the other consumer runs it.
	err = a.Nack(e.ctx(), adapters.NackAll([]*adapters.Delivery{stale}, 0))
	if e := adapters.EntryError(err, 0); !errors.Is(e, adapters.ErrLeaseLost) {
		t.Fatalf("giving back an entry another consumer claimed: %v, want an error wrapping adapters.ErrLeaseLost", err)
	}
	if p := e.pending(); len(p) != 1 || p[0].Consumer != b.Consumer() || p[0].Idle >= lease {
		t.Fatalf("pending after the refused give-back: %+v, want the entry with %s, not idle", p, b.Consumer())
	}
	if got := a.Stats().LeaseLost; got != 2 {
		t.Errorf("Stats.LeaseLost = %d, want 2", got)
	}
}

// TestRenewalResetsIdleTime checks what a renewal does on the server: the
// entry's idle time starts again and its delivery count stays, so another
// consumer cannot claim it while it is renewed, and its next delivery is
// counted right.
func TestRenewalResetsIdleTime(t *testing.T) {
	const lease = 300 * time.Millisecond
	e := newEnv(t)
	e.publish("one", "two")
	a := e.open(WithLease(lease))
	defer a.Close()
	ds := receiveN(t, a, 2)
	time.Sleep(lease / 2)
	if err := a.Extend(e.ctx(), ds, lease); err != nil {
		t.Fatalf("Extend: %v", err)
	}
	for _, p := range e.pending() {
		if p.Idle >= lease/2 || p.RetryCount != 1 || p.Consumer != a.Consumer() {
			t.Errorf("after the renewal: %+v, want idle below %v, delivery count 1, consumer %s", p, lease/2, a.Consumer())
		}
	}
	// Renewing for less than the lease (the runtime's cap on the hold)
	// makes the entry claimable that much sooner.
	if err := a.Extend(e.ctx(), ds[:1], lease/3); err != nil {
		t.Fatalf("Extend: %v", err)
	}
	if p := e.pending(); p[0].Idle < lease-lease/3-20*time.Millisecond {
		t.Errorf("after a renewal for a third of the lease, idle %v, want about %v", p[0].Idle, lease-lease/3)
	}
	if st := a.Stats(); st.Renewals != 2 || st.Renewed != 3 {
		t.Errorf("Stats: %d renewal calls for %d entries, want 2 for 3", st.Renewals, st.Renewed)
	}
}

// TestLongHandlerIsNotDeliveredTwice runs a handler for three leases on one
// of two live consumers: the runtime renews its entry (through Extend), so
// the other consumer's reclaims never take it.
func TestLongHandlerIsNotDeliveredTwice(t *testing.T) {
	const lease = 300 * time.Millisecond
	e := newEnv(t)
	e.publish("slow")
	var (
		mu    sync.Mutex
		calls []int
	)
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		calls = append(calls, m.Attempt)
		first := len(calls) == 1
		mu.Unlock()
		if first {
			select {
			case <-time.After(3 * lease):
			case <-ctx.Done():
				return context.Cause(ctx)
			}
		}
		return nil
	})
	srcA := e.open(WithLease(lease), WithReclaimInterval(20*time.Millisecond))
	a := start(t, srcA, h)
	waitFor(t, "the handler running", func() bool { mu.Lock(); defer mu.Unlock(); return len(calls) == 1 })
	srcB := e.open(WithLease(lease), WithReclaimInterval(20*time.Millisecond))
	b := start(t, srcB, h)
	waitFor(t, "the entry acked", func() bool { return len(e.pending()) == 0 })
	time.Sleep(2 * lease) // a late second delivery would show now
	a.stop()
	b.stop()
	mu.Lock()
	defer mu.Unlock()
	if len(calls) != 1 || calls[0] != 1 {
		t.Fatalf("handler calls (attempts) %v, want one, on the first delivery", calls)
	}
	if st := srcA.Stats(); st.Renewed < 2 {
		t.Errorf("Stats.Renewed = %d, want at least 2 for a handler running three leases", st.Renewed)
	}
	if st := srcB.Stats(); st.Reclaimed != 0 {
		t.Errorf("the other consumer reclaimed %d entries", st.Reclaimed)
	}
}

// holdHook holds every renewal script call until release is closed.
type holdHook struct{ release chan struct{} }

func (h holdHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h holdHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h holdHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if args := cmd.Args(); len(args) > 1 && args[1] == extendScript.Hash() {
			<-h.release
		}
		return next(ctx, cmd)
	}
}

// TestRenewalReturnsAtItsDeadline holds a renewal on its way to the server:
// Extend must return when its context ends, so that the runtime's lease
// keeper can cancel the handler before the lease runs out (go-redis itself
// waits for its ReadTimeout, not for the context), and Close must wait for
// the renewal still under way.
func TestRenewalReturnsAtItsDeadline(t *testing.T) {
	e := newEnv(t)
	e.publish("one")
	c := redis.NewClient(&redis.Options{Addr: redisAddr()})
	defer c.Close()
	hook := holdHook{release: make(chan struct{})}
	c.AddHook(hook)
	src, err := New(e.ctx(), c, e.stream, e.group, WithCreateGroup("0"), WithLogger(quiet()))
	if err != nil {
		t.Fatal(err)
	}
	ds := receiveN(t, src, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	returned := make(chan error, 1)
	go func() { returned <- src.Extend(ctx, ds, time.Second) }()
	select {
	case err := <-returned:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Extend past its deadline: %v, want an error wrapping context.DeadlineExceeded", err)
		}
	case <-time.After(time.Minute):
		close(hook.release)
		t.Fatal("Extend did not return at its context's deadline while the server had not answered")
	}
	closed := make(chan struct{})
	go func() { src.Close(); close(closed) }()
	select {
	case <-closed:
		t.Error("Close returned while a renewal was still under way")
	case <-time.After(50 * time.Millisecond):
	}
	close(hook.release)
	<-closed
}

// TestRenewalsAreBatched holds 60 entries under the runtime past their
// first renewal: the Source declares how many entries one renewal call
// takes, so the lease keeper renews them together, in one script call or
// a few, not ten at a time (its default for a source that declares
// nothing).
func TestRenewalsAreBatched(t *testing.T) {
	const n = 60
	e := newEnv(t)
	bodies := make([]string, n)
	for i := range bodies {
		bodies[i] = "x"
	}
	e.publish(bodies...)
	release := make(chan struct{})
	src := e.open(WithLease(300 * time.Millisecond))
	s := start(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	}), consumer.WithConcurrency(n), consumer.WithMaxInFlight(n))
	waitFor(t, "every held entry renewed", func() bool { return src.Stats().Renewed >= n })
	close(release)
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	st := src.Stats()
	if per := float64(st.Renewed) / float64(st.Renewals); per <= 10 {
		t.Errorf("%d entries renewed in %d calls: %.1f a call, want more than 10", st.Renewed, st.Renewals, per)
	}
}
