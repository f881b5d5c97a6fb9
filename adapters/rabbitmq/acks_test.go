package rabbitmq

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// A run of finished deliveries in tag order goes out as few multiple=true
// acks, and the broker forgets every one of them.
func TestAckCoalescesContiguousRun(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 40)...)
	s := openSource(t, q, WithPrefetch(64), WithAckCoalescing(16, 5*time.Millisecond, time.Second))
	ds := receiveN(t, s, 40)
	if err := s.Ack(context.Background(), ds); err != nil {
		t.Fatal(err)
	}
	waitUnacked(t, q, 0)
	st := s.Stats()
	if st.Acked != 40 {
		t.Fatalf("acked %d deliveries, want 40", st.Acked)
	}
	if st.AckFrames > 3 || st.MultipleAcks != st.AckFrames {
		t.Fatalf("sent %d ack frames (%d multiple) for 40 deliveries in order; want at most 3, all multiple", st.AckFrames, st.MultipleAcks)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if n := a.ready(q); n != 0 {
		t.Fatalf("%d messages came back after they were acked", n)
	}
}

// While the first delivery is still running, the finished ones behind it are
// not covered by a multiple ack: with a long straggler wait nothing is sent,
// and once the slow one finishes a single multiple ack settles all of them.
func TestAckNeverCoversUnfinishedTag(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 10)...)
	s := openSource(t, q, WithPrefetch(20), WithAckCoalescing(4, 5*time.Millisecond, time.Hour))
	ds := receiveN(t, s, 10)
	if string(ds[0].Body) != "m1" {
		t.Fatalf("first delivery is %q", ds[0].Body)
	}
	if err := s.Ack(context.Background(), ds[1:]); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // several lingers: nothing may go out
	if n := unacked(t, q); n != 10 {
		t.Fatalf("broker shows %d unacked with the first delivery unfinished and stragglers held; want 10", n)
	}
	if st := s.Stats(); st.AckFrames != 0 {
		t.Fatalf("sent %d ack frames while tag 1 was unfinished", st.AckFrames)
	}
	if err := s.Ack(context.Background(), ds[:1]); err != nil {
		t.Fatal(err)
	}
	waitUnacked(t, q, 0)
	if st := s.Stats(); st.AckFrames != 1 || st.MultipleAcks != 1 {
		t.Fatalf("sent %d ack frames (%d multiple), want one multiple ack", st.AckFrames, st.MultipleAcks)
	}
}

// With the default straggler wait, finished deliveries stuck behind a slow
// one are acked one by one, freeing the prefetch window, and the slow one
// stays unacked until it finishes: closing without finishing it gives it
// back, and only it.
func TestStragglersAckedIndividuallyWhileSlowOneRuns(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 10)...)
	s := openSource(t, q, WithPrefetch(20))
	ds := receiveN(t, s, 10)
	// Finish out of order: the even ones, then the odd ones but the first.
	var order []int
	for i := 1; i < 10; i += 2 {
		order = append(order, i)
	}
	for i := 2; i < 10; i += 2 {
		order = append(order, i)
	}
	for _, i := range order {
		if err := s.Ack(context.Background(), ds[i:i+1]); err != nil {
			t.Fatal(err)
		}
	}
	waitUnacked(t, q, 1) // the slow one is still in flight
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	a.waitReady(q, 1)
	back := a.drain(q)
	if len(back) != 1 || string(back[0].Body) != "m1" {
		t.Fatalf("after close the queue holds %v, want only the unfinished m1", back)
	}
}

// A finished delivery behind an unfinished one goes out on its own once it
// has waited its linger, even while the run before it keeps growing: with
// the defaults the ack is on the wire in about 5 ms, not when the frontier
// reaches it. (The straggler wait started again at every move of the
// frontier, so an ack waited for as long as the deliveries before it kept
// finishing, and a crash meanwhile repeated its effect.)
func TestAckBehindAnUnfinishedDeliveryGoesOutAfterItsLinger(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 42)...)
	s := openSource(t, q, WithPrefetch(64))
	ds := receiveN(t, s, 42)
	ctx := context.Background()
	slow, behind := ds[40], ds[41]
	if err := s.Ack(ctx, []*adapters.Delivery{behind}); err != nil {
		t.Fatal(err)
	}
	// The deliveries before the slow one finish one by one, 20 ms apart:
	// each moves the frontier, and none reaches the finished one behind.
	settled := false
	for _, d := range ds[:40] {
		if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
		g := handleOf(behind).gen
		g.mu.Lock()
		settled = settled || handleOf(behind).state == stateSettled
		g.mu.Unlock()
	}
	if !settled {
		t.Fatalf("the finished delivery behind the slow one was not acked while 40 deliveries before it finished over 800 ms; stats %+v", s.Stats())
	}
	if st := s.Stats(); st.AckFrames == st.MultipleAcks {
		t.Fatalf("stats %+v: want the delivery behind the slow one acked on its own", st)
	}
	if err := s.Ack(ctx, []*adapters.Delivery{slow}); err != nil {
		t.Fatal(err)
	}
	waitUnacked(t, q, 0)
	if st := s.Stats(); st.Generations != 1 || st.Acked != 42 {
		t.Fatalf("stats %+v: want 42 acked on one channel (a multiple ack naming a tag acked on its own closes it)", st)
	}
}

// Close sends acks still lingering, so nothing finished comes back.
func TestCloseFlushesLingeringAcks(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 5)...)
	s := openSource(t, q, WithPrefetch(20), WithAckCoalescing(64, time.Second, time.Hour))
	ds := receiveN(t, s, 5)
	if err := s.Ack(context.Background(), append(ds[:1:1], ds[2:]...)); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	a.waitReady(q, 1)
	back := a.drain(q)
	if len(back) != 1 || string(back[0].Body) != "m2" {
		t.Fatalf("after close the queue holds %d messages, want only the unfinished m2", len(back))
	}
}

// A second ack or a nack after an ack of the same delivery must not reach
// the broker: a repeated tag would close the channel.
func TestDoubleSettleIsHarmless(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1", "m2")
	s := openSource(t, q, WithPrefetch(20))
	ds := receiveN(t, s, 2)
	ctx := context.Background()
	if err := s.Ack(ctx, ds[:1]); err != nil {
		t.Fatal(err)
	}
	if err := s.Ack(ctx, ds[:1]); err != nil {
		t.Fatal(err)
	}
	if err := s.Nack(ctx, adapters.NackAll(ds[:1], 0)); err == nil {
		t.Fatal("Nack after Ack succeeded")
	}
	if err := s.Ack(ctx, ds[1:]); err != nil {
		t.Fatal(err)
	}
	waitUnacked(t, q, 0)
	if st := s.Stats(); st.Generations != 1 {
		t.Fatalf("the channel was replaced (%d generations): a repeated tag reached the broker", st.Generations)
	}
}

// A Nack with a delay after the delivery was acked, or a second one while it
// waits, must not publish a copy: the message would be handled twice.
func TestRetryAfterSettleIsRefused(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1", "m2")
	s := openSource(t, q, WithPrefetch(10))
	ctx := context.Background()
	ds := receiveN(t, s, 2)
	if err := s.Ack(ctx, ds[:1]); err != nil {
		t.Fatal(err)
	}
	if err := s.Nack(ctx, adapters.NackAll(ds[:1], time.Hour)); err == nil {
		t.Fatal("Nack with a delay after Ack succeeded")
	}
	if err := s.Nack(ctx, adapters.NackAll(ds[1:], 100*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if err := s.Nack(ctx, adapters.NackAll(ds[1:], 100*time.Millisecond)); err == nil {
		t.Fatal("second Nack of a waiting delivery succeeded")
	}
	again := receiveN(t, s, 1)
	if err := s.Ack(ctx, again); err != nil {
		t.Fatal(err)
	}
	waitUnacked(t, q, 0)
	if n := a.ready(q); n != 0 {
		t.Fatalf("%d copies on the queue, want none", n)
	}
	if st := s.Stats(); st.RetriedInPlace != 1 || st.DelayQueued != 0 {
		t.Fatalf("stats %+v: want exactly one retry copy", st)
	}
}

// A run of finished deliveries at the frontier goes out after the linger
// even when the ack timer was already armed for the (here one hour) straggler
// wait of deliveries that finished before the head: a timer armed for later
// must not hold back a run that is ready now.
func TestRunAtFrontierNotHeldBackByStragglerTimer(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 3)...)
	s := openSource(t, q, WithPrefetch(20), WithAckCoalescing(16, 5*time.Millisecond, time.Hour))
	ds := receiveN(t, s, 3)
	ctx := context.Background()
	if err := s.Ack(ctx, ds[1:]); err != nil { // stragglers: the timer is armed for an hour
		t.Fatal(err)
	}
	if err := s.Ack(ctx, ds[:1]); err != nil { // the head: a run of 3, below the batch of 16
		t.Fatal(err)
	}
	waitUnacked(t, q, 0) // within the linger, not the hour
	if st := s.Stats(); st.AckFrames != 1 || st.MultipleAcks != 1 {
		t.Fatalf("sent %d ack frames (%d multiple), want one multiple ack", st.AckFrames, st.MultipleAcks)
	}
}

// Deliveries still held when the Source closes are lost to Close and counted
// as such (Stats.Lost), like those lost to a dead channel.
func TestCloseCountsHeldDeliveriesAsLost(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1", "m2")
	s := openSource(t, q, WithPrefetch(10))
	ds := receiveN(t, s, 2)
	if err := s.Ack(context.Background(), ds[:1]); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(ds[1].Signal.LostCause(), adapters.ErrClosed) {
		t.Fatalf("held delivery lost with %v, want ErrClosed", ds[1].Signal.LostCause())
	}
	if st := s.Stats(); st.Lost != 1 {
		t.Fatalf("Stats().Lost = %d after Close gave back one held delivery, want 1", st.Lost)
	}
}

// A delivery handed to another queue's Source is refused, by Ack and by
// Nack, naming the mistake: settled there it would ack or requeue a message
// of a channel that Source does not own. It stays unacked with its own
// Source, and comes back when that one closes.
func TestSettlingAnotherSourcesDeliveryIsRefused(t *testing.T) {
	a := newAdmin(t)
	q1 := a.queue(ClassicQueue, nil)
	q2 := a.queue(ClassicQueue, nil)
	a.publish(q2, "m1")
	s1 := openSource(t, q1, WithPrefetch(10))
	s2 := openSource(t, q2, WithPrefetch(10))
	ctx := context.Background()
	d := receiveN(t, s2, 1)
	for _, err := range []error{s1.Ack(ctx, d), s1.Nack(ctx, adapters.NackAll(d, 0)), s1.Nack(ctx, adapters.NackAll(d, time.Second))} {
		var be *adapters.BatchError
		if !errors.As(err, &be) || be.Failed[0] == nil || !strings.Contains(be.Failed[0].Error(), "did not come from the Source") {
			t.Fatalf("settling another Source's delivery: %v, want it refused", err)
		}
	}
	if err := s2.Close(); err != nil {
		t.Fatal(err)
	}
	a.waitReady(q2, 1)
	if st := s2.Stats(); st.Acked != 0 || st.Rejects != 0 || st.RetriedInPlace != 0 {
		t.Fatalf("the delivery was settled through the other Source: %+v", st)
	}
}
