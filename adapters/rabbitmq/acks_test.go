package rabbitmq

import (
	"context"
	"errors"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
)

// A run of finished deliveries in tag order, acked in one call, is one
// multiple=true ack, written before Ack returns, and the broker forgets
// every one of them.
func TestAckOfARunIsOneMultipleAck(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 40)...)
	s := openSource(t, q, WithPrefetch(64))
	ds := receiveN(t, s, 40)
	if err := s.Ack(context.Background(), ds); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.Acked != 40 || st.AckFrames != 1 || st.MultipleAcks != 1 {
		t.Fatalf("when Ack returned: stats %+v; want 40 acked in one multiple ack", st)
	}
	waitUnacked(t, q, 0)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if n := a.ready(q); n != 0 {
		t.Fatalf("%d messages came back after they were acked", n)
	}
}

// Finished deliveries behind one still running are acked one by one when
// their Ack is called, never by a multiple ack, which would cover the one
// still running. When it finishes, its ack names its own tag only: a
// multiple ack naming the last tag would name one the broker no longer
// holds, and the broker would close the channel.
func TestAckBehindAnUnfinishedDeliveryIsWrittenAtOnce(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 10)...)
	s := openSource(t, q, WithPrefetch(20))
	ds := receiveN(t, s, 10)
	if string(ds[0].Body) != "m1" {
		t.Fatalf("first delivery is %q", ds[0].Body)
	}
	if err := s.Ack(context.Background(), ds[1:]); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.Acked != 9 || st.AckFrames != 9 || st.MultipleAcks != 0 {
		t.Fatalf("when Ack returned: stats %+v; want the 9 behind the running one acked one by one", st)
	}
	waitUnacked(t, q, 1)
	if err := s.Ack(context.Background(), ds[:1]); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.Acked != 10 || st.AckFrames != 10 {
		t.Fatalf("stats %+v: want the last one acked in one frame of its own", st)
	}
	waitUnacked(t, q, 0)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.Generations != 1 {
		t.Fatalf("stats %+v: the channel was replaced; the broker refused an ack", st)
	}
	if n := a.ready(q); n != 0 {
		t.Fatalf("%d messages came back after they were acked", n)
	}
}

// One Ack call holding both a delivery at the head and one behind a
// delivery still running writes a multiple ack for the run and a single ack
// beyond it, and leaves the running ones unacked.
func TestAckOfARunAndAStragglerInOneCall(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 6)...)
	s := openSource(t, q, WithPrefetch(20))
	ds := receiveN(t, s, 6)
	ctx := context.Background()
	if err := s.Ack(ctx, ds[1:2]); err != nil { // m2, behind m1
		t.Fatal(err)
	}
	// m1 and m3 join m2 in a run (m2 is settled already: the multiple ack
	// names m3); m5 is behind m4, still running.
	if err := s.Ack(ctx, []*adapters.Delivery{ds[2], ds[4], ds[0]}); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.Acked != 4 || st.AckFrames != 3 || st.MultipleAcks != 1 {
		t.Fatalf("stats %+v: want m2 alone, then one multiple ack for m1 and m3 and one ack for m5", st)
	}
	waitUnacked(t, q, 2)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	a.waitReady(q, 2)
	var back []string
	for _, m := range a.drain(q) {
		back = append(back, string(m.Body))
	}
	if len(back) != 2 || back[0] != "m4" || back[1] != "m6" {
		t.Fatalf("after close the queue holds %v, want the unfinished m4 and m6", back)
	}
}

// With one delivery still running, finished deliveries behind it are acked
// one by one and the slow one stays unacked until it finishes: closing
// without finishing it gives it back, and only it.
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

// An ack is on its way to the broker when Ack returns: a consumer whose
// socket is closed right after (as when its process is killed) does not get
// back what it acked, only what it had not.
func TestAckIsWrittenBeforeItReturns(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 4)...)
	var (
		mu    sync.Mutex
		conns []net.Conn
	)
	dial := func(network, addr string) (net.Conn, error) {
		c, err := net.Dial(network, addr)
		if err == nil {
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
		return c, err
	}
	s := openSource(t, q, WithPrefetch(10), WithConfig(amqp.Config{Dial: dial}),
		WithReconnectBackoff(10*time.Millisecond, 100*time.Millisecond))
	ds := receiveN(t, s, 4)
	// m1 at the head, m3 behind m2, which is still running.
	if err := s.Ack(context.Background(), []*adapters.Delivery{ds[0], ds[2]}); err != nil {
		t.Fatal(err)
	}
	// Half-close the socket: the broker reads every frame written before,
	// then the end of the stream. A full close could reset the connection
	// (the kernel does when unread data waits in it) and let the broker drop
	// frames it had received but not read, which would test the kernel, not
	// whether Ack wrote its frames before returning.
	mu.Lock()
	_ = conns[0].(*net.TCPConn).CloseWrite()
	mu.Unlock()
	waitGenerations(t, s, 2)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	a.waitReady(q, 2)
	var back []string
	for _, m := range a.drain(q) {
		back = append(back, string(m.Body))
	}
	slices.Sort(back)
	if len(back) != 2 || back[0] != "m2" || back[1] != "m4" {
		t.Fatalf("after the socket was closed the queue holds %v, want only the unacked m2 and m4", back)
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
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues())
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
		t.Fatal("second Nack of a retried delivery succeeded")
	}
	again := receiveN(t, s, 1)
	if err := s.Ack(ctx, again); err != nil {
		t.Fatal(err)
	}
	waitUnacked(t, q, 0)
	if n := a.ready(q); n != 0 {
		t.Fatalf("%d copies on the queue, want none", n)
	}
	if st := s.Stats(); st.DelayQueued != 1 || st.RetriedAtOnce != 0 {
		t.Fatalf("stats %+v: want exactly one retry copy", st)
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
	s1 := openSource(t, q1, WithPrefetch(10), WithDelayQueues())
	s2 := openSource(t, q2, WithPrefetch(10), WithDelayQueues())
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
	if st := s2.Stats(); st.Acked != 0 || st.Rejects != 0 || st.DelayQueued != 0 || st.RetriedAtOnce != 0 {
		t.Fatalf("the delivery was settled through the other Source: %+v", st)
	}
}
