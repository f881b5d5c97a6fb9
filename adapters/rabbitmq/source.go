package rabbitmq

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
)

// Source consumes one RabbitMQ queue. It implements adapters.Source; create
// it with New.
type Source struct {
	s     *settings
	queue string
	tag   string
	caps  adapters.Capabilities
	out   chan *adapters.Delivery
	pub   *publisher // retries: republish to the queue or a delay queue

	ctx    context.Context // cancelled by Close: ends waits and publishes
	cancel context.CancelFunc

	mu     sync.Mutex
	gen    *generation // current generation; nil while reconnecting
	genSeq uint64
	// lastDialErr is the last reconnection failure; dialErrNew says that
	// Receive has yet to report it (its kind, dialErrKind, is new).
	lastDialErr error
	dialErrKind string
	dialErrNew  bool
	// conn is the connection state Connection reports.
	conn    adapters.Connection
	closed  bool
	closing chan struct{}
	wg      sync.WaitGroup // supervisor, pumps

	stats counters
	tel   *telemetry

	// publishTimeout bounds the publishes of one retry (republishTimeout;
	// tests shorten it).
	publishTimeout time.Duration

	// testHookRepublished, when set by a test, runs between a retry's
	// confirmed copy and the original's ack.
	testHookRepublished func()
	// testHookChannelDied, when set by a test (under mu), runs on the
	// supervisor once it saw the generation die, before it marks it dead.
	testHookChannelDied func()
}

// New connects to the broker, checks or declares queue as the options say,
// and starts consuming it. It fails when the first connection cannot be made
// or the queue is missing; later connection losses are repaired in the
// background.
func New(ctx context.Context, queue string, opts ...Option) (*Source, error) {
	if queue == "" {
		return nil, errors.New("rabbitmq: New: the queue name is empty")
	}
	if err := checkShortstr("New", "queue name", queue); err != nil {
		return nil, err
	}
	st, err := applyFor("New", opts)
	if err != nil {
		return nil, err
	}
	tag := st.consumerTag
	if tag == "" {
		tag = defaultConsumerTag(queue)
	}
	tel, err := queueTelemetry(st.meters, queue)
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: New: telemetry: %w", err)
	}
	bg, cancel := context.WithCancel(context.Background())
	s := &Source{
		s:     st,
		queue: queue,
		tag:   tag,
		caps: adapters.Capabilities{
			Name:             "rabbitmq:" + queue,
			System:           "rabbitmq",
			NackDelay:        st.delayQueues,
			CountsDeliveries: st.countsDeliveries(),
			MaxLeaseAge:      st.maxHold(),
			MaxReceive:       st.prefetch,
			MaxUnacked:       st.prefetch,
			// An ack has no reply, but every call writes a frame or more: a
			// millisecond's linger lets a run of finished deliveries go out
			// as one multiple ack (0.06 frames a message in the no-op
			// benchmark, against 0.96 when each worker sent what gathered
			// as it went idle), and adds a millisecond to the duplicates a
			// crash can cause.
			Ack: adapters.Batching{Linger: time.Millisecond},
		},
		// Room for a full window from the live channel plus one left over
		// from a channel that just died (those are skipped).
		out:     make(chan *adapters.Delivery, 2*st.prefetch),
		pub:     newPublisher(st),
		ctx:     bg,
		cancel:  cancel,
		closing: make(chan struct{}),
		tel:     tel,

		publishTimeout: republishTimeout,
	}
	s.conn = adapters.Connection{State: adapters.Connecting, Since: time.Now()}
	g, err := s.connect(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	if st.delayQueues {
		// Whether this broker and user can have delay queues at all: found
		// out here, rather than by every retry publishing its copy to the
		// queue at once, without its delay.
		step := delayLadder[0]
		if err := s.pub.declareDelayQueue(ctx, delayQueueName(queue, step), step, queue); err != nil {
			g.die()
			_ = g.conn.CloseDeadline(time.Now().Add(st.closeTimeout))
			s.pub.close()
			cancel()
			return nil, fmt.Errorf("rabbitmq: New: WithDelayQueues: %w", err)
		}
	}
	s.install(g)
	s.wg.Add(1)
	go s.supervise(g)
	return s, nil
}

// defaultConsumerTag names the consumer after its queue. The tag is a short
// string, like the queue name, so a long name is cut (at a character
// boundary) to leave room for the prefix and the random suffix.
func defaultConsumerTag(queue string) string {
	suffix := randomSuffix()
	for len("custody-")+len(queue)+len("-")+len(suffix) > maxShortstr {
		_, size := utf8.DecodeLastRuneInString(queue)
		queue = queue[:len(queue)-size]
	}
	return "custody-" + queue + "-" + suffix
}

func randomSuffix() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Queue returns the name of the queue the Source consumes.
func (s *Source) Queue() string { return s.queue }

// Capabilities implements adapters.Source. RabbitMQ holds deliveries on the
// channel, not on a lease (Lease 0), for at most the consumer timeout less a
// margin (MaxLeaseAge); see the package documentation, sections Attempts and
// Retries.
func (s *Source) Capabilities() adapters.Capabilities { return s.caps }

// delivery converts an amqp091 delivery.
func (s *Source) delivery(m amqp.Delivery) *adapters.Delivery {
	native := m
	native.Acknowledger = nil // settling goes through the Source only
	return &adapters.Delivery{
		ID:              m.MessageId,
		Body:            m.Body,
		Headers:         stringHeaders(m.Headers),
		Attempt:         attemptOf(&m, s.caps.CountsDeliveries),
		Queue:           s.queue,
		Partition:       -1,
		Offset:          -1,
		PublishedAt:     m.Timestamp,
		FirstReceivedAt: firstReceivedOf(&m),
		ReceivedAt:      time.Now(),
		Native:          native,
	}
}

// Receive implements adapters.Source. It waits up to the poll wait (default
// 1 s) for a first delivery, then takes what else is buffered, up to max.
// While the adapter fails to reconnect, it returns the reconnection error
// after the poll wait, so the runtime can report it: once, and again only
// when the failure changes kind (a refused connection, then refused
// credentials, say), not once per attempt.
func (s *Source) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	if max < 1 {
		max = 1
	}
	select {
	case <-s.closing:
		return nil, adapters.ErrClosed
	default:
	}
	if err := ctx.Err(); err != nil {
		// Deliveries may wait in the buffer, and select would pick one of
		// them as readily as ctx.Done: handed out now, they would start
		// handlers after the runtime began to shut down.
		return nil, err
	}
	t := time.NewTimer(s.s.pollWait)
	defer t.Stop()
	var ds []*adapters.Delivery
	for len(ds) == 0 {
		select {
		case d := <-s.out:
			if d.Signal.LostCause() == nil {
				ds = append(ds, d)
			}
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-s.closing:
			return nil, adapters.ErrClosed
		case <-t.C:
			var err error
			s.mu.Lock()
			if s.gen == nil && s.dialErrNew {
				err, s.dialErrNew = s.lastDialErr, false
			}
			s.mu.Unlock()
			return nil, err
		}
	}
	for len(ds) < max {
		select {
		case d := <-s.out:
			if d.Signal.LostCause() == nil {
				ds = append(ds, d)
			}
		default:
			return ds, nil
		}
	}
	return ds, nil
}

// own returns d's handle, or an error when d did not come from this Source.
func (s *Source) own(d *adapters.Delivery) (*handle, error) {
	h := handleOf(d)
	if h == nil || h.gen.src != s {
		return nil, fmt.Errorf("rabbitmq: delivery %q did not come from the Source for queue %q", d.ID, s.queue)
	}
	return h, nil
}

// Ack implements adapters.Source. It writes the acks of ds before it returns
// (see the package documentation, section Acks go out at once). An entry
// whose channel died, or died while its ack was written, fails with
// ErrConnectionLost: the broker redelivers it. So does one already nacked,
// whose message comes back whatever the Ack says; acking a delivery again
// is no error.
func (s *Source) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	var failed entryErrors
	// The generations ds holds, nearly always one: the current one.
	var buf [2]*generation
	gens := buf[:0]
	for i, d := range ds {
		h, err := s.own(d)
		if err != nil {
			failed.set(i, err)
			continue
		}
		if !slices.Contains(gens, h.gen) {
			gens = append(gens, h.gen)
		}
	}
	for _, g := range gens {
		g.mu.Lock()
		g.ackLocked(ds, &failed, false)
		g.mu.Unlock()
	}
	return failed.err()
}

// Close implements adapters.Source: it closes the channel and the
// connection (the broker requeues what was not acked), and waits for the
// adapter's goroutines to end.
func (s *Source) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.setConnLocked(adapters.Disconnected, nil)
	close(s.closing)
	g := s.gen
	s.gen = nil
	s.mu.Unlock()
	s.cancel()
	var err error
	if g != nil {
		s.lose(g.die(), adapters.ErrClosed)
		// amqp091 waits for the broker's channel.close-ok with no limit of
		// its own, only its heartbeat timeout (some 30 s): a broker that
		// stopped answering would hold Close past a deployment's grace
		// period. At the close timeout, closing the connection ends that
		// wait (every ack is written already).
		late := time.AfterFunc(s.s.closeTimeout, func() { _ = g.conn.CloseDeadline(time.Now()) })
		cerr := g.ch.Close()
		if !late.Stop() {
			err = fmt.Errorf("rabbitmq: close channel: the broker did not answer within %v", s.s.closeTimeout)
		} else if cerr != nil && !errors.Is(cerr, amqp.ErrClosed) {
			err = fmt.Errorf("rabbitmq: close channel: %w", cerr)
		}
		if cerr := g.conn.CloseDeadline(time.Now().Add(s.s.closeTimeout)); cerr != nil && !errors.Is(cerr, amqp.ErrClosed) && err == nil {
			err = fmt.Errorf("rabbitmq: close connection: %w", cerr)
		}
	}
	s.wg.Wait()
	s.pub.close()
	return err
}
