package memory

import (
	"bytes"
	"cmp"
	"container/heap"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/custody-go/custody/adapters"
)

// ErrNoQueue is returned for a queue that was not created.
var ErrNoQueue = errors.New("memory: no such queue; create it with Broker.CreateQueue")

// Broker is an in-process message broker with lease semantics. It is safe
// for concurrent use. The zero value is not usable; call NewBroker.
type Broker struct {
	mu       sync.Mutex
	queues   map[string]*queue
	seq      uint64
	receipt  uint64
	batch    uint64 // Receive calls that took messages, to tell them apart
	idPrefix string // starts the IDs Publish generates (see newIDPrefix)
}

// NewBroker returns an empty broker.
func NewBroker() *Broker {
	return &Broker{queues: make(map[string]*queue), idPrefix: newIDPrefix()}
}

// newIDPrefix returns "m-", 64 random bits in hex and "-"; a generated ID
// adds the broker's publish sequence number. A sequence number alone starts
// over in every broker, and an idempotency store that outlives the broker
// would take the new broker's first message for the old one's and skip its
// effect.
func newIDPrefix() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return "m-" + hex.EncodeToString(b[:]) + "-"
}

// QueueOptions configures a queue.
type QueueOptions struct {
	// Lease is the visibility timeout: how long a received message stays
	// invisible before it is delivered again. Default 30s. Any positive
	// duration works; tests use milliseconds. (consumer.New refuses a lease
	// it would renew more often than every millisecond: below 3ms at the
	// default renewal fraction of a third.)
	Lease time.Duration
	// FIFO delivers messages with the same Message.Key (the group) in
	// publish order, one at a time: a group is blocked while one of its
	// messages is received and not yet acked, or waiting for a delayed
	// redelivery. Publish refuses a message without a Key, as SQS refuses
	// one without a MessageGroupId. A dead-letter copy without one
	// (DeadLetterQueue.Send of a delivery from a standard queue or another
	// broker) gets its ID as its Key: a group of its own.
	FIFO bool
	// MaxReceiveCount, when positive, moves a message to DeadLetterQueue
	// instead of delivering it for the (MaxReceiveCount+1)th time, as an SQS
	// redrive policy does. The moved message keeps its ID, body, key,
	// headers and publish time, and gains the headers adapters.HeaderOriginalQueue and
	// adapters.HeaderAttempts; diagnostic headers from an earlier trip to a
	// dead-letter queue are dropped.
	MaxReceiveCount int
	// DeadLetterQueue names the queue redriven messages go to. It must exist
	// when MaxReceiveCount is set, and must be empty when it is not. As with
	// SQS, it must be FIFO when this queue is, and standard when it is not.
	DeadLetterQueue string
}

// Message is a message to publish, or one read back with Messages.
type Message struct {
	// ID identifies the message; Publish generates one when empty, unique
	// across brokers and processes (see the package documentation).
	ID      string
	Body    []byte
	Headers map[string]string
	// Key is the ordering key: the group of a FIFO queue. The runtime's
	// OrderByKey option orders by it on standard queues too.
	Key string
	// Receives counts how often the message was received (read back only).
	Receives int
}

// Stats counts what happened on a queue.
type Stats struct {
	Visible  int   // messages ready to be received
	InFlight int   // received or delayed, not yet acked
	Received int64 // receive events, redeliveries included
	Acked    int64 // messages deleted by an ack
	Redriven int64 // messages moved to the dead-letter queue by MaxReceiveCount
	Extended int64 // successful lease extensions
}

// CreateQueue creates a queue. Creating a queue that exists fails.
func (b *Broker) CreateQueue(name string, opts QueueOptions) error {
	if name == "" {
		return errors.New("memory: CreateQueue: empty queue name")
	}
	if opts.Lease < 0 {
		return fmt.Errorf("memory: CreateQueue(%q): QueueOptions.Lease %v must not be negative", name, opts.Lease)
	}
	if opts.Lease == 0 {
		opts.Lease = 30 * time.Second
	}
	if opts.MaxReceiveCount < 0 {
		return fmt.Errorf("memory: CreateQueue(%q): QueueOptions.MaxReceiveCount %d must not be negative", name, opts.MaxReceiveCount)
	}
	if opts.DeadLetterQueue != "" && opts.MaxReceiveCount == 0 {
		// Without a count nothing is ever redriven: a poison message the
		// caller meant to move aside would come back for ever.
		return fmt.Errorf("memory: CreateQueue(%q): QueueOptions.DeadLetterQueue %q needs a positive MaxReceiveCount", name, opts.DeadLetterQueue)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if opts.MaxReceiveCount > 0 {
		dlq, ok := b.queues[opts.DeadLetterQueue]
		if !ok {
			return fmt.Errorf("memory: CreateQueue(%q): QueueOptions.DeadLetterQueue %q must name an existing queue when MaxReceiveCount is set", name, opts.DeadLetterQueue)
		}
		if dlq.opts.FIFO != opts.FIFO {
			// SQS refuses such a redrive policy; a test that passed here
			// would describe a queue pair that cannot be created there.
			return fmt.Errorf("memory: CreateQueue(%q): QueueOptions.DeadLetterQueue %q must be of the same type as the queue (FIFO %t, dead-letter queue FIFO %t), as SQS requires",
				name, opts.DeadLetterQueue, opts.FIFO, dlq.opts.FIFO)
		}
	}
	if _, ok := b.queues[name]; ok {
		return fmt.Errorf("memory: CreateQueue(%q): queue exists", name)
	}
	b.queues[name] = newQueue(name, opts)
	return nil
}

// Publish appends messages to a queue, in order. It keeps copies of their
// bodies and headers, so the caller may reuse its buffers, as with a network
// broker. On a FIFO queue every message needs a Key; if one has none,
// Publish publishes none of them.
func (b *Broker) Publish(ctx context.Context, queueName string, msgs ...Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	now := time.Now()
	b.mu.Lock()
	defer b.mu.Unlock()
	q, ok := b.queues[queueName]
	if !ok {
		return fmt.Errorf("memory: Publish(%q): %w", queueName, ErrNoQueue)
	}
	if q.opts.FIFO {
		// The runtime orders deliveries by a non-empty key only: keyless
		// messages received together would be handled side by side, out of
		// the order the queue promises.
		for i, m := range msgs {
			if m.Key == "" {
				return fmt.Errorf("memory: Publish(%q): message %d has an empty Message.Key; a FIFO queue needs one, its group", queueName, i)
			}
		}
	}
	for _, m := range msgs {
		m.Body, m.Headers = bytes.Clone(m.Body), maps.Clone(m.Headers)
		b.publishLocked(q, m, now)
	}
	return nil
}

// publishLocked appends m to q, published at the given time.
func (b *Broker) publishLocked(q *queue, m Message, published time.Time) {
	b.seq++
	id := m.ID
	if id == "" {
		id = b.idPrefix + strconv.FormatUint(b.seq, 10)
	}
	key := m.Key
	if key == "" && q.opts.FIFO {
		// Only a dead-letter copy (DeadLetterQueue.Send) gets here
		// keyless: Publish refuses such messages. Each gets a group of
		// its own, its ID, so that one copy in flight holds up no other.
		key = id
	}
	msg := &message{id: id, body: m.Body, headers: m.Headers, key: key, seq: b.seq, published: published, ready: true}
	heap.Push(&q.ready, msg)
	q.signal()
}

// lookup returns the named queue.
func (b *Broker) lookup(name string) (*queue, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	q, ok := b.queues[name]
	return q, ok
}

// Stats returns a queue's counters.
func (b *Broker) Stats(queueName string) (Stats, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	q, ok := b.queues[queueName]
	if !ok {
		return Stats{}, fmt.Errorf("memory: Stats(%q): %w", queueName, ErrNoQueue)
	}
	q.promote(time.Now())
	s := q.stats
	s.Visible = len(q.ready)
	s.InFlight = len(q.waiting)
	return s, nil
}

// WaitEmpty waits until the named queue holds no message: none visible,
// none received and not yet acked, none waiting out a delay, that is, every
// message was acked (dead-lettered ones too) or moved to the dead-letter
// queue by MaxReceiveCount (see the package documentation, section Testing
// with it). Give ctx a deadline, so that a message that is never settled
// fails the test rather than hanging it. It returns ctx's error if ctx ends
// first, and at once if the queue is empty already.
func (b *Broker) WaitEmpty(ctx context.Context, queueName string) error {
	for {
		b.mu.Lock()
		q, ok := b.queues[queueName]
		if !ok {
			b.mu.Unlock()
			return fmt.Errorf("memory: WaitEmpty(%q): %w", queueName, ErrNoQueue)
		}
		if q.empty() {
			b.mu.Unlock()
			return nil
		}
		if q.emptied == nil {
			q.emptied = make(chan struct{})
		}
		emptied := q.emptied
		b.mu.Unlock()
		select {
		case <-emptied:
			// Checked again: a publish may have come since.
		case <-ctx.Done():
			return fmt.Errorf("memory: WaitEmpty(%q): %w", queueName, ctx.Err())
		}
	}
}

// Messages returns a copy of every message in a queue, visible or not, in
// publish order. Use it to inspect a dead-letter queue. Headers are copied;
// bodies are the broker's own and must not be modified.
func (b *Broker) Messages(queueName string) ([]Message, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	q, ok := b.queues[queueName]
	if !ok {
		return nil, fmt.Errorf("memory: Messages(%q): %w", queueName, ErrNoQueue)
	}
	all := q.messages()
	out := make([]Message, len(all))
	for i, m := range all {
		out[i] = Message{ID: m.id, Body: m.body, Headers: maps.Clone(m.headers), Key: m.key, Receives: m.receives}
	}
	return out, nil
}

// sortBySeq sorts a copy of the queue's messages. It must not go through a
// readyHeap: heap moves rewrite message.index, the position each message has
// in the queue's own heaps, and a later ack would remove the wrong message.
func sortBySeq(ms []*message) {
	slices.SortFunc(ms, func(a, b *message) int { return cmp.Compare(a.seq, b.seq) })
}

// receive takes up to max visible messages and leases them to src. It
// returns the deliveries whose old holders lost them, to be told outside the
// lock, and when the next message becomes visible.
func (b *Broker) receive(q *queue, src *Source, max int, now time.Time, out []*adapters.Delivery) ([]*adapters.Delivery, []*adapters.Delivery, time.Time) {
	var lostHolders []*adapters.Delivery
	next := q.promote(now)
	b.batch++
	var (
		skipped []*message
		taken   map[string]bool // FIFO groups this call already takes from
	)
	for len(out) < max && len(q.ready) > 0 {
		m := heap.Pop(&q.ready).(*message)
		m.ready = false
		if q.opts.FIFO && q.busy[m.key] > 0 && !taken[m.key] {
			// An earlier message of the group is held elsewhere: the group
			// waits. Messages of a group this call already takes from come
			// along in order, as SQS returns them.
			skipped = append(skipped, m)
			continue
		}
		if q.opts.FIFO {
			if taken == nil {
				taken = map[string]bool{}
			}
			taken[m.key] = true
		}
		m.receives++
		if q.opts.MaxReceiveCount > 0 && m.receives > q.opts.MaxReceiveCount {
			if m.holder != nil {
				lostHolders = append(lostHolders, m.holder)
			}
			m.deleted = true
			q.stats.Redriven++
			dlq := b.queues[q.opts.DeadLetterQueue]
			h := withoutDiagnostics(m.headers)
			h[adapters.HeaderOriginalQueue] = q.name
			h[adapters.HeaderAttempts] = strconv.Itoa(m.receives - 1)
			// The move keeps the original publish time, as an SQS redrive
			// keeps the enqueue timestamp: the copy is the same message.
			b.publishLocked(dlq, Message{ID: m.id, Body: m.body, Headers: h, Key: m.key}, m.published)
			continue
		}
		q.stats.Received++
		if m.firstReceived.IsZero() {
			m.firstReceived = now
		}
		if m.holder != nil {
			lostHolders = append(lostHolders, m.holder)
		}
		b.receipt++
		m.receipt = b.receipt
		m.batch = b.batch
		m.visibleAt = now.Add(q.opts.Lease)
		heap.Push(&q.waiting, m)
		if q.opts.FIFO {
			q.hold(m)
		}
		h := &handle{m: m, receipt: m.receipt, src: src}
		d := &adapters.Delivery{
			ID:              m.id,
			Body:            m.body,
			Headers:         m.headers,
			Key:             m.key,
			Attempt:         m.receives,
			Queue:           q.name,
			Partition:       -1,
			Offset:          -1,
			PublishedAt:     m.published,
			FirstReceivedAt: m.firstReceived,
			ReceivedAt:      now,
			Handle:          h,
			Signal:          &h.signal,
		}
		if q.opts.FIFO {
			d.OrderingKey = m.key
		}
		d.Native = Message{ID: m.id, Body: m.body, Headers: m.headers, Key: m.key, Receives: m.receives}
		m.holder = d
		out = append(out, d)
	}
	for _, m := range skipped {
		m.ready = true
		heap.Push(&q.ready, m)
	}
	if len(q.waiting) > 0 && (next.IsZero() || q.waiting[0].visibleAt.Before(next)) {
		next = q.waiting[0].visibleAt
	}
	q.noteIfEmpty() // the messages redriven may have been its last
	return out, lostHolders, next
}

// withoutDiagnostics copies headers for a dead-letter copy, without the
// diagnostic headers of an earlier trip (the message was dead-lettered and
// replayed), which would mix with the new ones.
func withoutDiagnostics(headers map[string]string) map[string]string {
	h := make(map[string]string, len(headers)+12)
	for k, v := range headers {
		if !adapters.IsDiagnosticHeader(k) {
			h[k] = v
		}
	}
	return h
}

// handle is a delivery's receipt: valid while the message is not deleted and
// nobody received it since.
type handle struct {
	m       *message
	receipt uint64
	src     *Source
	// signal tells the holder that another receive took the message.
	signal adapters.Signal
}

func (h *handle) valid() bool { return !h.m.deleted && h.m.receipt == h.receipt }

var errStaleReceipt = fmt.Errorf("memory: stale receipt (the message was received again or deleted): %w", adapters.ErrLeaseLost)
