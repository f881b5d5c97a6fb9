package rabbitmq

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// A requeue (Nack without a delay: the runtime gives a delivery back) comes
// back with the attempt the broker counts. A quorum queue counts every
// delivery (x-delivery-count); a classic queue only flags a redelivery,
// which counts as one more attempt, a lower bound, where the Source counts
// deliveries (retries through delay queues carry their count) and not at
// all where it does not (Attempt 0: the runtime counts its own attempts).
func TestNackWithoutDelayRequeuesAndCountsAttempts(t *testing.T) {
	cases := []struct {
		name   string
		typ    QueueType
		opts   []Option
		counts bool
		want   [3]int
	}{
		{"classic", ClassicQueue, nil, false, [3]int{0, 0, 0}},
		{"classic with delay queues", ClassicQueue, []Option{WithDelayQueues()}, true, [3]int{1, 2, 2}},
		{"quorum declared", QuorumQueue, []Option{WithDeclare(QuorumQueue, nil)}, true, [3]int{1, 2, 3}},
		{"quorum checked", QuorumQueue, nil, false, [3]int{0, 2, 3}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			a := newAdmin(t)
			q := a.queue(c.typ, nil)
			a.publish(q, "m1")
			s := openSource(t, q, append([]Option{WithPrefetch(10)}, c.opts...)...)
			if got := s.Capabilities().CountsDeliveries; got != c.counts {
				t.Fatalf("CountsDeliveries %v, want %v", got, c.counts)
			}
			ctx := context.Background()
			var got [3]int
			for i := range got {
				d := receiveN(t, s, 1)[0]
				got[i] = d.Attempt
				if i == len(got)-1 {
					if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
						t.Fatal(err)
					}
					break
				}
				if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 0)); err != nil {
					t.Fatal(err)
				}
			}
			if got != c.want {
				t.Fatalf("attempts %v over two requeues, want %v", got, c.want)
			}
			waitUnacked(t, q, 0)
		})
	}
}

// Without delay queues the broker cannot hold a message back, so the Source
// reports NackDelay=false, and a Nack, whatever its delay, gives the
// delivery back at once: the runtime waits out retries in place itself.
func TestNackWithoutDelayQueuesRequeuesAtOnce(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publishMsg(q, amqp.Publishing{MessageId: "id-1", Body: []byte("m1"), Headers: amqp.Table{"h": "v"}})
	s := openSource(t, q, WithPrefetch(10))
	if c := s.Capabilities(); c.NackDelay {
		t.Fatalf("capabilities %+v: NackDelay without delay queues", c)
	}
	ctx := context.Background()
	d := receiveN(t, s, 1)[0]
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, time.Hour)); err != nil {
		t.Fatal(err)
	}
	d = receiveN(t, s, 1)[0] // at once, not in an hour
	if d.ID != "id-1" || string(d.Body) != "m1" || d.Headers["h"] != "v" {
		t.Fatalf("requeued message: id %q body %q headers %v", d.ID, d.Body, d.Headers)
	}
	if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
	waitUnacked(t, q, 0)
	if st := s.Stats(); st.Rejects != 1 || st.DelayQueued+st.RetriedAtOnce != 0 {
		t.Fatalf("stats %+v: want one requeue and no copy", st)
	}
}

// Under the runtime, without delay queues, a failing message waits out its
// backoff in place: it is delivered once, never given back nor copied, the
// runtime counts its attempts, and the worker handles other messages while
// it waits.
func TestRetriesWaitInPlaceUnderTheRuntime(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "slow")
	s := openSource(t, q, WithPrefetch(10))
	var (
		mu       sync.Mutex
		attempts []int
		other    = make(chan struct{})
		done     = make(chan struct{})
	)
	r := runConsumer(t, s, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if m.ID == "other" {
			close(other)
			return nil
		}
		mu.Lock()
		attempts = append(attempts, m.Attempt)
		n := len(attempts)
		mu.Unlock()
		switch n {
		case 1:
			// Published now: handled only if the worker is free meanwhile.
			a.publish(q, "other")
			return errors.New("not yet")
		case 2:
			select {
			case <-other:
			default:
				t.Error("the other message was not handled while the retry waited")
			}
			return errors.New("not yet")
		}
		close(done)
		return nil
	}), consumer.WithConcurrency(1),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 5, Backoff: consumer.ConstantBackoff(300 * time.Millisecond)}))
	<-done
	r.stop(t)
	mu.Lock()
	got := slices.Clone(attempts)
	mu.Unlock()
	if !slices.Equal(got, []int{1, 2, 3}) {
		t.Fatalf("attempts %v, want 1, 2, 3", got)
	}
	if st := s.Stats(); st.Delivered != 2 || st.Rejects != 0 || st.DelayQueued+st.RetriedAtOnce != 0 {
		t.Fatalf("stats %+v: want each message delivered once, the retries waiting in place", st)
	}
	waitUnacked(t, q, 0)
	if n := a.ready(q); n != 0 {
		t.Fatalf("%d messages left on the queue", n)
	}
}

// A queue whose name leaves no room for the delay queue's suffix in the 255
// bytes of an AMQP short string still retries through a delay queue, named
// with a hash to fit.
func TestRetryThroughDelayQueueOfALongQueueName(t *testing.T) {
	a := newAdmin(t)
	q := uniqueName(t, "long")
	q += strings.Repeat("q", maxShortstr-len(q))
	a.declare(q, ClassicQueue, nil)
	a.publish(q, "m1")
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues())
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
	if st := s.Stats(); st.DelayQueued != 1 || st.RetriedAtOnce != 0 {
		t.Fatalf("stats %+v: want one retry through the delay queue", st)
	}
}

// With delay queues, a delayed retry goes through a delay queue that
// dead-letters back to the source queue; the original is acked once the
// copy is confirmed, so the delivery is not held while it waits.
func TestRetryThroughDelayQueue(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1")
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues())
	if c := s.Capabilities(); !c.NackDelay || !c.CountsDeliveries {
		t.Fatalf("capabilities %+v: want NackDelay and CountsDeliveries with delay queues", c)
	}
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
// arguments), the retry's copy is published to the queue at once, keeping
// its attempt count, rather than lost. The broker's refusal is remembered:
// the next retry does not declare it again, which would cost a failed
// declare and a new connection each time.
func TestRetryGoesToTheQueueWhenTheDelayQueueFails(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.declare(delayQueueName(q, 250*time.Millisecond), ClassicQueue, amqp.Table{"x-max-length": int64(5)})
	a.publish(q, "m1")
	var dials atomic.Int32
	counted := func(network, addr string) (net.Conn, error) {
		dials.Add(1)
		return net.Dial(network, addr)
	}
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues(), WithConfig(amqp.Config{Dial: counted}))
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
	if st := s.Stats(); st.RetryFailures != 2 || st.RetriedAtOnce != 2 || st.DelayQueued != 0 {
		t.Fatalf("stats %+v: want two failed delay-queue publishes and two copies to the queue", st)
	}
	// The consumer's connection, the publisher's (New declares a delay
	// queue on it; the refused declare closes it), and the publisher's
	// again for the copies.
	if n := dials.Load(); n != 3 {
		t.Fatalf("%d connections dialed, want 3: the refused declare was tried again", n)
	}
}

// New checks that delay queues can be declared, rather than let every
// retry find out: here the queue New would declare exists with other
// arguments.
func TestNewFailsWhenDelayQueuesCannotBeDeclared(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.declare(delayQueueName(q, delayLadder[0]), ClassicQueue, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := New(ctx, q, WithURL(brokerURL), WithDelayQueues())
	if err == nil {
		s.Close()
		t.Fatal("New succeeded with a delay queue the broker refuses")
	}
	if !strings.Contains(err.Error(), "WithDelayQueues") {
		t.Fatalf("New: %v; want the error to name WithDelayQueues", err)
	}
}

// The capabilities say who waits out retries and who counts attempts: the
// runtime in place unless delay queues hold retries back; the broker or the
// retries' copies where they count. MaxLeaseAge keeps a delivery clear of
// the broker's consumer timeout.
func TestCapabilitiesSayWhoWaitsAndWhoCounts(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	for _, c := range []struct {
		opts              []Option
		nackDelay, counts bool
		maxAge            time.Duration
	}{
		{nil, false, false, 29 * time.Minute},
		{[]Option{WithDelayQueues()}, true, true, 29 * time.Minute},
		{[]Option{WithConsumerTimeout(2 * time.Second)}, false, false, 1500 * time.Millisecond},
	} {
		caps := openSource(t, q, c.opts...).Capabilities()
		if caps.NackDelay != c.nackDelay || caps.CountsDeliveries != c.counts || caps.MaxLeaseAge != c.maxAge {
			t.Errorf("capabilities %+v, want NackDelay %v, CountsDeliveries %v, MaxLeaseAge %v", caps, c.nackDelay, c.counts, c.maxAge)
		}
	}
	qq := a.queue(QuorumQueue, nil)
	if caps := openSource(t, qq, WithDeclare(QuorumQueue, nil)).Capabilities(); caps.NackDelay || !caps.CountsDeliveries {
		t.Errorf("declared quorum queue: capabilities %+v, want CountsDeliveries without NackDelay", caps)
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
// retry whose confirm never comes must give up and requeue the original
// instead of holding the runtime, and the publisher, until the alarm clears.
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
// makes) after the first retry used it. The second Nack must return within
// within, its retry given up and the original requeued; both come back at
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
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues(), WithConfig(amqp.Config{Dial: counted}))
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
	// A first retry goes through the publishing connection New opened;
	// then the broker blocks that connection.
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
	if st := s.Stats(); st.DelayQueued != 1 || st.RetryFailures != 1 || st.RetriedAtOnce != 0 || st.Rejects != 1 {
		t.Fatalf("stats %+v: want one delay-queue retry, and one that gave up on the blocked publisher and was requeued", st)
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
// contract), and the original be requeued, rather than hold the runtime,
// the publisher and every later retry until the alarm clears.
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

// An Ack of a delivery already nacked fails: the message comes back (as the
// retry's copy, or requeued), so an Ack returning nil would report settled a
// message that is delivered again, even though through a delay queue the
// original is acked on the wire with the copy's confirm. A second Nack
// fails likewise, rather than publish a second copy.
func TestAckOrNackAfterDelayedNackFails(t *testing.T) {
	_, _, s, d := holdOne(t, WithDelayQueues())
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
// retries' copies, which are published through the default exchange and
// dead-lettered from a delay queue: after four retries its dead-letter copy
// still names the exchange and routing key it was first published with.
func TestRetriesKeepTheOriginalRoute(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	ex := a.exchangeTo(q, "orders.created")
	dc, err := a.ch.PublishWithDeferredConfirm(ex, "orders.created", true, false, amqp.Publishing{MessageId: "id-1", Body: []byte("m1")})
	if err != nil || !dc.Wait() {
		t.Fatalf("publish through %s: %v", ex, err)
	}
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues())
	x := openSink(t, "", dlq)
	ctx := context.Background()
	d := receiveN(t, s, 1)[0]
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
	if st := s.Stats(); st.DelayQueued != 4 {
		t.Fatalf("stats %+v: want four retries through a delay queue", st)
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
// policy) makes the next retry through it unroutable: that one's copy goes
// to the queue at once, and the retry after it declares the delay queue
// again rather than losing its delay for good.
func TestDeletedDelayQueueIsDeclaredAgain(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1")
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues())
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
	if st := s.Stats(); st.DelayQueued != 2 || st.RetryFailures != 1 || st.RetriedAtOnce != 1 {
		t.Fatalf("stats %+v: want the first and third retries through the delay queue, the second to the queue at once", st)
	}
}

// A delayed retry of a delivery whose connection amqp091 already saw close,
// before the adapter marked its generation dead, publishes no copy: the
// original can no longer be acked and comes back, so a copy would be a
// second delivery of the message.
func TestRetryOnAClosedChannelPublishesNoCopy(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1")
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues(),
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
// original requeued.
func TestNackReturnsWhenThePublishingChannelDoesNotOpen(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1")
	r := startMuteRelay(t)
	var dials atomic.Int32
	s, err := New(context.Background(), q, WithPrefetch(10), WithDelayQueues(),
		WithDialFunc(func(ctx context.Context) (*amqp.Connection, error) {
			if dials.Add(1) <= 2 {
				return amqp.Dial(brokerURL) // the consumer's, and the publisher's for New's check
			}
			// The publisher's next, through the relay, muted once it is
			// made. Heartbeats an hour apart: amqp091 gives up on a silent
			// broker only after three of them.
			c, err := amqp.DialConfig(r.url(), amqp.Config{Heartbeat: time.Hour})
			r.muted.Store(true)
			return c, err
		}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	s.publishTimeout = 300 * time.Millisecond
	s.pub.mu.Lock()
	s.pub.resetLocked() // the next publish dials again, through the relay
	s.pub.mu.Unlock()
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
	if st := s.Stats(); st.RetryFailures != 1 || st.Rejects != 1 {
		t.Fatalf("stats %+v: want the delay-queue retry given up and the original requeued", st)
	}
	if again := receiveN(t, s, 1)[0]; again.ID != "m1" {
		t.Fatalf("received %q, want m1 back", again.ID)
	}
}
