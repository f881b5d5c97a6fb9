package rabbitmq

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
)

func TestNackWithoutDelayRequeuesAndCountsAttempts(t *testing.T) {
	for _, typ := range []QueueType{ClassicQueue, QuorumQueue} {
		t.Run(typ.String(), func(t *testing.T) {
			a := newAdmin(t)
			q := a.queue(typ, nil)
			a.publish(q, "m1")
			s := openSource(t, q, WithPrefetch(10))
			ctx := context.Background()
			d := receiveN(t, s, 1)[0]
			if d.Attempt != 1 {
				t.Fatalf("first delivery has Attempt %d", d.Attempt)
			}
			if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 0)); err != nil {
				t.Fatal(err)
			}
			d = receiveN(t, s, 1)[0]
			if d.Attempt != 2 {
				t.Fatalf("after one requeue Attempt is %d, want 2", d.Attempt)
			}
			if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 0)); err != nil {
				t.Fatal(err)
			}
			d = receiveN(t, s, 1)[0]
			want := 3 // quorum queues count every delivery
			if typ == ClassicQueue {
				want = 2 // classic queues only flag a redelivery: a lower bound
			}
			if d.Attempt != want {
				t.Fatalf("after two requeues Attempt is %d, want %d", d.Attempt, want)
			}
			if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
				t.Fatal(err)
			}
			waitUnacked(t, q, 0)
		})
	}
}

// A short delay is waited out in place, then the message is republished with
// the next attempt number and the original acked. On a classic queue the
// attempt count stays exact across retries, which requeueing cannot give.
func TestRetryInPlaceRepublishesNextAttempt(t *testing.T) {
	for _, typ := range []QueueType{ClassicQueue, QuorumQueue} {
		t.Run(typ.String(), func(t *testing.T) {
			a := newAdmin(t)
			q := a.queue(typ, nil)
			a.publishMsg(q, amqp.Publishing{MessageId: "id-1", Body: []byte("m1"), Headers: amqp.Table{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}})
			s := openSource(t, q, WithPrefetch(10))
			ctx := context.Background()
			first := receiveN(t, s, 1)[0]
			d := first
			for attempt := 1; attempt <= 3; attempt++ {
				if d.Attempt != attempt {
					t.Fatalf("delivery %d has Attempt %d", attempt, d.Attempt)
				}
				if d.ID != "id-1" || string(d.Body) != "m1" || d.Headers["traceparent"] == "" {
					t.Fatalf("retry lost the message's identity: id %q body %q headers %v", d.ID, d.Body, d.Headers)
				}
				if attempt == 3 {
					break
				}
				nacked := time.Now()
				if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 150*time.Millisecond)); err != nil {
					t.Fatal(err)
				}
				d = receiveN(t, s, 1)[0]
				if waited := time.Since(nacked); waited < 150*time.Millisecond {
					t.Fatalf("retry came back after %v, before its delay", waited)
				}
			}
			if !d.FirstReceivedAt.Equal(first.ReceivedAt.UTC()) {
				t.Fatalf("FirstReceivedAt %v, want the first receive %v", d.FirstReceivedAt, first.ReceivedAt)
			}
			if d.Headers[HeaderOriginalRoutingKey] != q {
				t.Fatalf("original routing key header %q, want %q", d.Headers[HeaderOriginalRoutingKey], q)
			}
			if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
				t.Fatal(err)
			}
			waitUnacked(t, q, 0)
			// An in-place retry is counted after its original's ack is
			// sent, which the broker may report before the count is made.
			waitUntil(t, "both retries counted", func() bool {
				st := s.Stats()
				return st.RetriedInPlace+st.DelayQueued+st.RetryFailures == 2
			})
			if st := s.Stats(); st.RetriedInPlace != 2 || st.DelayQueued != 0 {
				t.Fatalf("stats %+v: want two in-place retries", st)
			}
			if n := a.ready(q); n != 0 {
				t.Fatalf("%d copies left on the queue: an original was not acked", n)
			}
		})
	}
}

// A queue whose name leaves no room for the delay queue's suffix in the 255
// bytes of an AMQP short string still retries through a delay queue, named
// with a hash: the broker refused the longer name, and every such retry
// waited in place and cost the channel.
func TestRetryThroughDelayQueueOfALongQueueName(t *testing.T) {
	a := newAdmin(t)
	q := uniqueName(t, "long")
	q += strings.Repeat("q", maxShortstr-len(q))
	a.declare(q, ClassicQueue, nil)
	a.publish(q, "m1")
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues(0))
	d := receiveN(t, s, 1)[0]
	if err := s.Nack(context.Background(), adapters.NackAll([]*adapters.Delivery{d}, 200*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	d = receiveN(t, s, 1)[0]
	if d.Attempt != 2 {
		t.Fatalf("Attempt %d after the delay queue, want 2", d.Attempt)
	}
	name := delayQueueName(q, 250*time.Millisecond)
	if len(name) > maxShortstr || !strings.Contains(d.Headers["x-death"], name) {
		t.Fatalf("x-death %q does not show the delay queue %q (%d bytes)", d.Headers["x-death"], name, len(name))
	}
	if st := s.Stats(); st.DelayQueued != 1 || st.RetriedInPlace != 0 {
		t.Fatalf("stats %+v: want one retry through the delay queue, none in place", st)
	}
}

// A delay above the threshold goes through a delay queue that dead-letters
// back to the source queue; the worker is not held and neither is the
// delivery.
func TestRetryThroughDelayQueue(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1")
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues(0))
	ctx := context.Background()
	d := receiveN(t, s, 1)[0]
	nacked := time.Now()
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 200*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	d = receiveN(t, s, 1)[0]
	waitUnacked(t, q, 1) // the copy only: the original was acked once the copy was confirmed
	if waited := time.Since(nacked); waited < 250*time.Millisecond {
		t.Fatalf("retry came back after %v, before its rounded-up delay of 250ms", waited)
	}
	if d.Attempt != 2 {
		t.Fatalf("Attempt %d after the delay queue, want 2", d.Attempt)
	}
	if !strings.Contains(d.Headers["x-death"], delayQueueName(q, 250*time.Millisecond)) {
		t.Fatalf("x-death %q does not show the delay queue", d.Headers["x-death"])
	}
	// And again: the broker's x-death from the first trip must not make it
	// drop the second one as a dead-letter cycle.
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 200*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	d = receiveN(t, s, 1)[0]
	if d.Attempt != 3 {
		t.Fatalf("Attempt %d after the second trip, want 3", d.Attempt)
	}
	if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.DelayQueued != 2 {
		t.Fatalf("stats %+v: want two delay-queue retries", st)
	}
}

// When the delay queue cannot be declared (here: it exists with other
// arguments), the retry waits in place instead of being lost. The broker's
// refusal is remembered: the next retry waits in place without declaring
// it again, which would cost a failed declare and a new connection each
// time.
func TestRetryFallsBackInPlaceWhenDelayQueueFails(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.declare(delayQueueName(q, 250*time.Millisecond), ClassicQueue, amqp.Table{"x-max-length": int64(5)})
	a.publish(q, "m1")
	var dials atomic.Int32
	counted := func(network, addr string) (net.Conn, error) {
		dials.Add(1)
		return net.Dial(network, addr)
	}
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues(0), WithConfig(amqp.Config{Dial: counted}))
	ctx := context.Background()
	d := receiveN(t, s, 1)[0]
	for attempt := 2; attempt <= 3; attempt++ {
		if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 200*time.Millisecond)); err != nil {
			t.Fatal(err)
		}
		d = receiveN(t, s, 1)[0]
		if d.Attempt != attempt {
			t.Fatalf("Attempt %d, want %d", d.Attempt, attempt)
		}
	}
	if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
	waitUnacked(t, q, 0)
	// The in-place retries are counted after their originals' acks are sent.
	waitUntil(t, "every try counted", func() bool { st := s.Stats(); return st.RetryFailures+st.RetriedInPlace == 4 })
	if st := s.Stats(); st.RetryFailures != 2 || st.RetriedInPlace != 2 {
		t.Fatalf("stats %+v: want two failed delay-queue publishes and two in-place retries", st)
	}
	// The consumer's connection, the publisher's for the refused declare
	// (which the broker's channel error ends), and the publisher's again
	// for the copies.
	if n := dials.Load(); n != 3 {
		t.Fatalf("%d connections dialed, want 3: the refused declare was tried again", n)
	}
}

func TestDelayStepRoundsUp(t *testing.T) {
	cases := map[time.Duration]time.Duration{
		time.Millisecond:        100 * time.Millisecond,
		time.Second:             time.Second,
		1100 * time.Millisecond: 2 * time.Second,
		6 * time.Minute:         7 * time.Minute,
		100 * time.Hour:         24 * time.Hour,
	}
	for in, want := range cases {
		if got := delayStep(in); got != want {
			t.Errorf("delayStep(%v) = %v, want %v", in, got, want)
		}
	}
	for i := 1; i < len(delayLadder); i++ {
		if r := float64(delayLadder[i]) / float64(delayLadder[i-1]); r > 2.5 {
			t.Errorf("step %v after %v rounds up by %.1fx", delayLadder[i], delayLadder[i-1], r)
		}
	}
}

// recordingHandler keeps the messages of log records, and their duration
// attributes by key.
type recordingHandler struct {
	mu        sync.Mutex
	msgs      []string
	durations map[string][]time.Duration
}

func (r *recordingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (r *recordingHandler) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.msgs = append(r.msgs, rec.Message)
	rec.Attrs(func(a slog.Attr) bool {
		if a.Value.Kind() == slog.KindDuration {
			if r.durations == nil {
				r.durations = map[string][]time.Duration{}
			}
			r.durations[a.Key] = append(r.durations[a.Key], a.Value.Duration())
		}
		return true
	})
	return nil
}
func (r *recordingHandler) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *recordingHandler) WithGroup(string) slog.Handler      { return r }
func (r *recordingHandler) contains(s string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range r.msgs {
		if strings.Contains(m, s) {
			return true
		}
	}
	return false
}

// Without delay queues (the default), an in-place wait is cut short, with a warning, so the
// delivery is never held to the broker's consumer timeout (which would close
// the channel and lose every delivery on it).
func TestInPlaceWaitStaysClearOfConsumerTimeout(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1")
	logs := &recordingHandler{}
	s := openSource(t, q, WithPrefetch(10), WithConsumerTimeout(2*time.Second), WithLogger(slog.New(logs)))
	d := receiveN(t, s, 1)[0]
	nacked := time.Now()
	if err := s.Nack(context.Background(), adapters.NackAll([]*adapters.Delivery{d}, time.Hour)); err != nil {
		t.Fatal(err)
	}
	d = receiveN(t, s, 1)[0]
	if waited := time.Since(nacked); waited > 30*time.Second {
		t.Fatalf("held for %v", waited)
	}
	if d.Attempt != 2 {
		t.Fatalf("Attempt %d, want 2", d.Attempt)
	}
	if !logs.contains("consumer timeout") {
		t.Fatalf("no warning about the consumer timeout; logged %v", logs.msgs)
	}
	// The wait it settled for, not a measured time: three quarters of the
	// timeout at most, so a slow handler or a loaded broker leaves room.
	logs.mu.Lock()
	waits := slices.Clone(logs.durations["waiting"])
	logs.mu.Unlock()
	if len(waits) != 1 || waits[0] > 1500*time.Millisecond {
		t.Fatalf("in-place waits logged %v, want one of at most 1.5s (3/4 of the 2s consumer timeout)", waits)
	}
	if st := s.Stats(); st.Generations != 1 {
		t.Fatalf("the channel was replaced: %+v", st)
	}
	if err := s.Ack(context.Background(), []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
}

// Close during an in-place retry, after the copy was confirmed and before the
// original was acked, waits for the ack: closing the channel in between
// would bring the original back beside its copy.
func TestCloseWaitsForAnInPlaceRetryBetweenCopyAndAck(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1")
	s := openSource(t, q, WithPrefetch(10))
	d := receiveN(t, s, 1)[0]

	closed := make(chan error, 1)
	s.testHookRepublished = func() {
		go func() { closed <- s.Close() }()
		// Give Close every chance to close the channel under the retry.
		time.Sleep(200 * time.Millisecond)
	}
	if err := s.Nack(context.Background(), adapters.NackAll([]*adapters.Delivery{d}, 10*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	ms := a.drain(q)
	if len(ms) != 1 {
		t.Fatalf("%d messages on the queue after Close, want the retry's copy alone", len(ms))
	}
	if got := ms[0].Headers[HeaderAttempt]; got != int64(2) {
		t.Fatalf("the message left is not the copy: %s = %v", HeaderAttempt, got)
	}
}

// blockableConn passes bytes through until blocked, then swallows what the
// client writes but its heartbeats, as a broker that blocks publishers under
// a resource alarm stops acting on them (and stops checking heartbeats):
// publishes seem to go out, the connection stays up, and no confirm comes.
type blockableConn struct {
	net.Conn
	blocked atomic.Bool
}

// heartbeatFrame is an AMQP heartbeat: type 8, channel 0, no payload.
var heartbeatFrame = []byte{8, 0, 0, 0, 0, 0, 0, 0xce}

func (c *blockableConn) Write(b []byte) (int, error) {
	if c.blocked.Load() && !bytes.Equal(b, heartbeatFrame) {
		return len(b), nil
	}
	return c.Conn.Write(b)
}

// Nack must return in bounded time even when the broker does not answer (the
// adapter contract; the runtime's settle context never ends). A delay-queue
// retry whose confirm never comes must give up and wait in place instead of
// holding the runtime's worker, and the publisher, until the alarm clears.
func TestNackReturnsWhileThePublisherIsBlocked(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1", "m2")
	nackWhilePublisherBlocked(t, q, func(network, addr string) (net.Conn, blocker, error) {
		c, err := net.DialTimeout(network, addr, 10*time.Second)
		if err != nil {
			return nil, nil, err
		}
		bc := &blockableConn{Conn: c}
		return bc, bc, nil
	}, 60*time.Second, "Nack still waits for a confirm the blocked broker never sends")
}

// blocker is a test connection the broker can be made to stop acting on.
type blocker interface {
	block()
	close()
}

func (c *blockableConn) block() { c.blocked.Store(true) }
func (c *blockableConn) close() { c.Close() }

// nackWhilePublisherBlocked retries the first two deliveries of q through a
// delay queue, blocking the publishing connection (the second one dial
// makes) after the first retry opened it. The second Nack must return within
// within, its retry given up and waiting in place instead; both come back at
// attempt 2.
func nackWhilePublisherBlocked(t *testing.T, q string, dial func(network, addr string) (net.Conn, blocker, error), within time.Duration, stuck string) {
	t.Helper()
	var (
		mu    sync.Mutex
		conns []blocker
	)
	counted := func(network, addr string) (net.Conn, error) {
		c, b, err := dial(network, addr)
		if err != nil {
			return nil, err
		}
		mu.Lock()
		conns = append(conns, b)
		mu.Unlock()
		return c, nil
	}
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues(0), WithConfig(amqp.Config{Dial: counted}))
	// Runs before the Source's own cleanup: a publish stuck on a blocked
	// connection must not also hang Close when this test fails.
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.close()
		}
	})
	s.publishTimeout = 300 * time.Millisecond
	ctx := context.Background()
	ds := receiveN(t, s, 2)
	// A first retry opens the publishing connection and declares the delay
	// queue; then the broker blocks that connection.
	if err := s.Nack(ctx, adapters.NackAll(ds[:1], 100*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	if len(conns) != 2 {
		mu.Unlock()
		t.Fatalf("%d connections dialed, want the consumer's and the publisher's", len(conns))
	}
	conns[1].block()
	mu.Unlock()
	done := make(chan error, 1)
	go func() { done <- s.Nack(ctx, adapters.NackAll(ds[1:], 100*time.Millisecond)) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(within):
		t.Fatal(stuck)
	}
	got := receiveN(t, s, 2)
	for _, d := range got {
		if d.Attempt != 2 {
			t.Fatalf("%s came back at attempt %d, want 2", d.ID, d.Attempt)
		}
	}
	if err := s.Ack(ctx, got); err != nil {
		t.Fatal(err)
	}
	waitUnacked(t, q, 0)
	// The in-place retry is counted after its original's ack is sent.
	waitUntil(t, "every try counted", func() bool {
		st := s.Stats()
		return st.DelayQueued+st.RetryFailures+st.RetriedInPlace == 3
	})
	if st := s.Stats(); st.DelayQueued != 1 || st.RetryFailures != 1 || st.RetriedInPlace != 1 {
		t.Fatalf("stats %+v: want one delay-queue retry, and one that gave up on the blocked publisher and waited in place", st)
	}
}

// stallingRelay stands between amqp091 and the broker. Once stalled, it
// stops reading what the client sends beyond a few socket buffers' worth, as
// RabbitMQ stops reading from a connection it blocks under a resource alarm:
// a client write that does not fit then blocks, as on a real socket, until
// its deadline or until the connection closes.
type stallingRelay struct {
	client, relay, broker net.Conn // client is the end amqp091 writes to
	stalled               atomic.Bool
	done                  chan struct{}
	once                  sync.Once
}

// stallBuffers is what a stalled relay still takes in: the socket buffers.
const stallBuffers = 256 << 10

func dialStallingRelay(network, addr string) (*stallingRelay, error) {
	b, err := net.DialTimeout(network, addr, 10*time.Second)
	if err != nil {
		return nil, err
	}
	c, r := net.Pipe()
	sr := &stallingRelay{client: c, relay: r, broker: b, done: make(chan struct{})}
	go func() {
		_, _ = io.Copy(r, b)
		sr.close()
	}()
	go func() {
		defer sr.close()
		buf := make([]byte, 32<<10)
		taken := 0 // since the stall
		for {
			n := len(buf)
			if sr.stalled.Load() {
				if taken >= stallBuffers {
					<-sr.done
					return
				}
				n = min(n, stallBuffers-taken)
			}
			n, err := r.Read(buf[:n])
			if sr.stalled.Load() {
				taken += n
			}
			if _, werr := b.Write(buf[:n]); werr != nil || err != nil {
				return
			}
		}
	}()
	return sr, nil
}

func (sr *stallingRelay) close() {
	sr.once.Do(func() {
		close(sr.done)
		sr.relay.Close()
		sr.broker.Close()
	})
}

// A retry's copy too large for the socket buffers, published while the
// broker blocks the publishing connection, blocks amqp091's write itself,
// where no context reaches. Nack must return all the same (the adapter
// contract), and the retry wait in place instead, rather than hold the
// runtime's worker, the publisher and every later retry until the alarm
// clears.
func TestNackReturnsWhenALargeCopyBlocksTheWrite(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1")
	big := bytes.Repeat([]byte("x"), 4*stallBuffers)
	a.publishMsg(q, amqp.Publishing{MessageId: "big", Body: big, DeliveryMode: amqp.Persistent})
	nackWhilePublisherBlocked(t, q, func(network, addr string) (net.Conn, blocker, error) {
		sr, err := dialStallingRelay(network, addr)
		if err != nil {
			return nil, nil, err
		}
		return sr.client, sr, nil
	}, 30*time.Second, // the broker's own heartbeat timeout (60 s) would end the write
		"Nack still blocked in the write of a copy the blocked broker does not read")
}

func (sr *stallingRelay) block() { sr.stalled.Store(true) }

// holdOne publishes one message to a fresh classic queue and returns a
// Source (prefetch 10, and opts) holding its delivery.
func holdOne(t *testing.T, opts ...Option) (*admin, string, *Source, *adapters.Delivery) {
	t.Helper()
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1")
	s := openSource(t, q, append([]Option{WithPrefetch(10)}, opts...)...)
	return a, q, s, receiveN(t, s, 1)[0]
}

// A delivery waiting in place for its retry and then given back at once
// (Nack without a delay) is requeued by the broker, and its wait publishes
// no copy when it ends: the message would be handled twice. A second retry,
// started after the first wait, is the mark: once its copy is back, the
// first wait has long ended.
func TestRequeuedWhileWaitingInPlacePublishesNoCopy(t *testing.T) {
	a, q, s, d := holdOne(t)
	ctx := context.Background()
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 100*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 0)); err != nil {
		t.Fatalf("requeue of a delivery waiting in place: %v", err)
	}
	again := receiveN(t, s, 1)[0]
	if again.Attempt != 2 || again.Headers[HeaderAttempt] != "" {
		t.Fatalf("after the requeue: attempt %d, %s %q; want the broker's redelivery, attempt 2", again.Attempt, HeaderAttempt, again.Headers[HeaderAttempt])
	}
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{again}, 100*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	next := receiveN(t, s, 1)[0]
	if next.Attempt != 3 {
		t.Fatalf("the next delivery has attempt %d (%s %q), want the second retry's copy, attempt 3", next.Attempt, HeaderAttempt, next.Headers[HeaderAttempt])
	}
	if err := s.Ack(ctx, []*adapters.Delivery{next}); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if n := a.ready(q); n != 0 {
		t.Fatalf("%d messages left: the requeued delivery's wait published a copy", n)
	}
	if st := s.Stats(); st.RetriedInPlace != 1 {
		t.Fatalf("stats %+v: want one copy, the second retry's", st)
	}
}

// An Ack of a delivery already nacked fails: the message comes back (as the
// retry's copy, or requeued), so an Ack returning nil would report settled a
// message that is delivered again. Through a delay queue the original is
// acked on the wire with the copy's confirm, which once made the late Ack
// look like a repeated one and return nil. A second Nack fails likewise,
// rather than publish a second copy.
func TestAckOrNackAfterDelayedNackFails(t *testing.T) {
	_, _, s, d := holdOne(t, WithDelayQueues(5*time.Second))
	ctx := context.Background()
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, time.Minute)); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.DelayQueued != 1 {
		t.Fatalf("stats %+v: want the retry through a delay queue", st)
	}
	if err := s.Ack(ctx, []*adapters.Delivery{d}); adapters.EntryError(err, 0) == nil {
		t.Fatalf("Ack of a delivery nacked through a delay queue returned %v, want its entry failed", err)
	}
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, time.Minute)); adapters.EntryError(err, 0) == nil {
		t.Fatalf("a second Nack returned %v, want its entry failed", err)
	}
	if st := s.Stats(); st.DelayQueued != 1 {
		t.Fatalf("stats %+v: want one copy", st)
	}
}

// A message published through a named exchange keeps that route in its
// retries' copies, which are published through the default exchange (in
// place) or dead-lettered from a delay queue: after two retries of each
// kind its dead-letter copy still names the exchange and routing key it was
// first published with.
func TestRetriesKeepTheOriginalRoute(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	ex := a.exchangeTo(q, "orders.created")
	dc, err := a.ch.PublishWithDeferredConfirm(ex, "orders.created", true, false, amqp.Publishing{MessageId: "id-1", Body: []byte("m1")})
	if err != nil || !dc.Wait() {
		t.Fatalf("publish through %s: %v", ex, err)
	}
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues(200*time.Millisecond))
	x := openSink(t, "", dlq)
	ctx := context.Background()
	d := receiveN(t, s, 1)[0]
	// Two in place, then two through a delay queue.
	for _, delay := range []time.Duration{100 * time.Millisecond, 100 * time.Millisecond, 250 * time.Millisecond, 250 * time.Millisecond} {
		if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, delay)); err != nil {
			t.Fatal(err)
		}
		d = receiveN(t, s, 1)[0]
		if d.Headers[HeaderOriginalExchange] != ex || d.Headers[HeaderOriginalRoutingKey] != "orders.created" {
			t.Fatalf("attempt %d names the original route %q/%q, want %q/%q", d.Attempt,
				d.Headers[HeaderOriginalExchange], d.Headers[HeaderOriginalRoutingKey], ex, "orders.created")
		}
	}
	if st := s.Stats(); st.DelayQueued != 2 {
		t.Fatalf("stats %+v: want two retries through a delay queue", st)
	}
	if err := x.Send(ctx, d, adapters.Failure{Err: errors.New("boom"), Attempts: d.Attempt}); err != nil {
		t.Fatal(err)
	}
	if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
	got := a.drain(dlq)
	if len(got) != 1 {
		t.Fatalf("dead-letter queue holds %d messages, want 1", len(got))
	}
	h := stringHeaders(got[0].Headers)
	if h[HeaderOriginalExchange] != ex || h[HeaderOriginalRoutingKey] != "orders.created" || h[adapters.HeaderAttempts] != "5" {
		t.Fatalf("dead-letter copy: original route %q/%q, attempts %q; want %q/%q after 5 attempts",
			h[HeaderOriginalExchange], h[HeaderOriginalRoutingKey], h[adapters.HeaderAttempts], ex, "orders.created")
	}
}

// A delay queue deleted behind the adapter's back (by an operator, or a
// policy) makes the next retry through it unroutable: that one waits in
// place, and the retry after it declares the delay queue again rather than
// waiting in place for good.
func TestDeletedDelayQueueIsDeclaredAgain(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1")
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues(0))
	ctx := context.Background()
	delayQueue := delayQueueName(q, 250*time.Millisecond)
	d := receiveN(t, s, 1)[0]
	for attempt := 1; attempt <= 3; attempt++ {
		if attempt == 2 {
			if _, err := a.ch.QueueDelete(delayQueue, false, false, false); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 200*time.Millisecond)); err != nil {
			t.Fatal(err)
		}
		d = receiveN(t, s, 1)[0]
		if d.Attempt != attempt+1 {
			t.Fatalf("Attempt %d after retry %d, want %d", d.Attempt, attempt, attempt+1)
		}
	}
	if !strings.Contains(d.Headers["x-death"], delayQueue) {
		t.Fatalf("the third retry did not pass the delay queue: x-death %q", d.Headers["x-death"])
	}
	if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
	waitUnacked(t, q, 0)
	if st := s.Stats(); st.DelayQueued != 2 || st.RetryFailures != 1 {
		t.Fatalf("stats %+v: want the first and third retries through the delay queue, the second failed there", st)
	}
}

// A delayed retry of a delivery whose connection amqp091 already saw close,
// before the adapter marked its generation dead, publishes no copy: the
// original can no longer be acked and comes back, so a copy would be a
// second delivery of the message. (A handler failing as the connection
// drops gets there, and so does a native dead letter whose reject failed
// on the closing channel: the runtime retries it through Nack at once.)
func TestRetryOnAClosedChannelPublishesNoCopy(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1")
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues(0),
		WithReconnectBackoff(10*time.Millisecond, 100*time.Millisecond))
	// The delay queue exists whether or not a copy goes to it.
	const delay = 30 * time.Second
	a.declare(delayQueueName(q, delayStep(delay)), QuorumQueue, delayQueueArgs(delayStep(delay), q))
	d := receiveN(t, s, 1)[0]
	release := killConnectionAndHoldSupervisor(t, s)
	err := s.Nack(context.Background(), adapters.NackAll([]*adapters.Delivery{d}, delay))
	release()
	if !errors.Is(adapters.EntryError(err, 0), adapters.ErrConnectionLost) {
		t.Errorf("Nack on the closed connection returned %v, want ErrConnectionLost", err)
	}
	if n := a.ready(delayQueueName(q, delayStep(delay))); n != 0 {
		t.Fatalf("%d copies in the delay queue, beside the original the broker redelivers", n)
	}
	again := receiveN(t, s, 1)[0]
	if err := s.Ack(context.Background(), []*adapters.Delivery{again}); err != nil {
		t.Fatal(err)
	}
}

// A delay-queue retry whose publishing connection is made but whose broker
// then answers nothing (opening the publishing channel waits for ever, or
// until three heartbeats pass) still returns from Nack in bounded time, the
// retry waiting in place instead.
func TestNackReturnsWhenThePublishingChannelDoesNotOpen(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1")
	r := startMuteRelay(t)
	var dials atomic.Int32
	s, err := New(context.Background(), q, WithPrefetch(10), WithDelayQueues(0),
		WithDialFunc(func(ctx context.Context) (*amqp.Connection, error) {
			if dials.Add(1) == 1 {
				return amqp.Dial(brokerURL) // the consumer's connection
			}
			// The publisher's, through the relay, muted once it is made.
			// Heartbeats an hour apart: amqp091 gives up on a silent broker
			// only after three of them.
			c, err := amqp.DialConfig(r.url(), amqp.Config{Heartbeat: time.Hour})
			r.muted.Store(true)
			return c, err
		}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	s.publishTimeout = 300 * time.Millisecond
	d := receiveN(t, s, 1)[0]
	done := make(chan error, 1)
	go func() {
		done <- s.Nack(context.Background(), adapters.NackAll([]*adapters.Delivery{d}, 100*time.Millisecond))
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("Nack still waits for a publishing channel the broker does not open")
	}
	if st := s.Stats(); st.RetryFailures != 1 {
		t.Fatalf("stats %+v: want the delay-queue retry given up", st)
	}
}
