package adapters

import (
	"reflect"
	"sync"
	"sync/atomic"
	"time"
)

// Delivery is one received message as the runtime holds it. Adapters create
// deliveries and fill the exported fields; the runtime reads them and must not
// change them. A Delivery is handed to the runtime once and stays owned by the
// adapter's bookkeeping until it is acked, nacked or lost.
type Delivery struct {
	// ID is the broker's identity of the message, stable across
	// redeliveries where the broker has one (SQS MessageId, AMQP message-id,
	// Kafka topic/partition/offset).
	ID string
	// Body is the payload.
	Body []byte
	// Headers are the message's attributes or headers, as strings.
	Headers map[string]string
	// Key is the message's own key (Kafka record key, SQS FIFO group id),
	// empty when it has none.
	Key string
	// OrderingKey names the lane the delivery must be processed in: the
	// runtime never runs two deliveries with the same non-empty OrderingKey
	// at once, and runs them in the order received. Empty means unordered.
	OrderingKey string
	// Attempt is the broker's delivery count, 1 on the first delivery, or 0
	// when the broker does not count deliveries.
	Attempt int

	// Queue is the queue or topic the message was read from.
	Queue string
	// Partition and Offset locate a Kafka record; -1 when not applicable.
	Partition int32
	Offset    int64

	// PublishedAt is when the message was published, if the broker says.
	PublishedAt time.Time
	// FirstReceivedAt is when any consumer first received the message, if
	// the broker says; else the zero time.
	FirstReceivedAt time.Time
	// ReceivedAt is when this delivery was received.
	ReceivedAt time.Time
	// LeasedAt is when the adapter last renewed the delivery's lease before
	// handing it over (an SQS message kept invisible while it waited in the
	// Source), or the zero time when it did not. The runtime counts the
	// lease it keeps alive from the later of ReceivedAt and LeasedAt, and
	// caps on the total hold time (Capabilities.MaxLeaseAge) from
	// ReceivedAt.
	LeasedAt time.Time

	// Native is the broker's own message (for As). Adapters document its
	// type.
	Native any
	// Handle is adapter-private state: a receipt handle, a delivery tag and
	// channel generation, an assignment epoch. The runtime never reads it.
	Handle any

	mu     sync.Mutex
	lost   error
	lostAt time.Time
	onLost func(error)
	// signals holds the channels Lost and RecallSignal hand out, made when
	// first asked for: most deliveries never need one. Guarded by mu.
	signals *deliverySignals
	// flags holds flagLost, flagRecalled and flagSettled: set under mu,
	// read without it. The runtime asks whether a delivery is lost or
	// recalled several times per message, nearly always of one that is
	// neither, which an atomic load answers without the lock. (One word for
	// all three keeps a Delivery in its allocation size class.)
	flags atomic.Uint32
}

// deliverySignals are a Delivery's channels, made on demand.
type deliverySignals struct {
	lost   chan struct{} // closed by Lose
	recall chan struct{} // closed by Recall
}

const (
	flagLost uint32 = 1 << iota
	flagRecalled
	flagSettled
)

// setFlag sets f; called with mu held.
func (d *Delivery) setFlag(f uint32) { d.flags.Or(f) }

func (d *Delivery) hasFlag(f uint32) bool { return d.flags.Load()&f != 0 }

// madeLocked returns *ch, made on the first call (closed at once if what it
// signals happened already); called with mu held.
func madeLocked(ch *chan struct{}, happened bool) chan struct{} {
	if *ch == nil {
		*ch = make(chan struct{})
		if happened {
			close(*ch)
		}
	}
	return *ch
}

// signalsLocked returns d's channels, making them; called with mu held.
func (d *Delivery) signalsLocked() *deliverySignals {
	if d.signals == nil {
		d.signals = &deliverySignals{}
	}
	return d.signals
}

// Lose marks the delivery as no longer ackable by this consumer and says why.
// It cancels the handler's context with cause (see context.Cause). Only the
// first call has an effect; it is safe to call from any goroutine.
func (d *Delivery) Lose(cause error) {
	d.mu.Lock()
	if d.lost != nil {
		d.mu.Unlock()
		return
	}
	if cause == nil {
		cause = ErrLeaseLost
	}
	d.lost = cause
	d.lostAt = time.Now()
	d.setFlag(flagLost)
	fn := d.onLost
	d.onLost = nil
	if d.signals != nil && d.signals.lost != nil {
		close(d.signals.lost)
	}
	d.mu.Unlock()
	if fn != nil {
		fn(cause)
	}
}

// LostCause returns the cause given to Lose, or nil while the delivery is
// still held.
func (d *Delivery) LostCause() error {
	if !d.hasFlag(flagLost) {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.lost
}

// LostAt returns when Lose was first called, or the zero time while the
// delivery is still held. The runtime compares it with when it received
// other deliveries: one received after the loss may be the lost message's
// redelivery (a Kafka partition assigned again, a new AMQP channel) and is
// not behind it in its lane.
func (d *Delivery) LostAt() time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.lostAt
}

// Lost returns a channel closed when the delivery is lost.
func (d *Delivery) Lost() <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	return madeLocked(&d.signalsLocked().lost, d.lost != nil)
}

// OnLost registers fn to run (once, on the goroutine that calls Lose) when the
// delivery is lost; at once if it already is. It replaces an earlier
// registration. The runtime uses it to cancel the handler's context without a
// goroutine per message. OnLost(nil) removes the registration.
func (d *Delivery) OnLost(fn func(error)) {
	d.mu.Lock()
	if d.lost != nil {
		cause := d.lost
		d.mu.Unlock()
		if fn != nil {
			fn(cause)
		}
		return
	}
	d.onLost = fn
	d.mu.Unlock()
}

// Recall asks the runtime to give the delivery back if its handler has not
// started yet. The adapter calls it when it wants the message back soon but
// can still take an ack: a Kafka partition being revoked, whose revoke waits
// for the partition's handed-out records to be settled. The runtime checks
// for a recall before each handler attempt (the first one and every retry in
// place) and while a retry waits out its backoff; a recalled delivery that
// is not running is nacked with no delay (counted as released), and the
// recalled jobs queued behind it in its lane then go the same way, each as it
// is reached.
//
// A handler already running is not disturbed: its context is not cancelled,
// and its outcome is settled as usual (an ack still counts). Recall is no
// loss; call Lose for that.
//
// The runtime keeps a lane's order only if, of the deliveries of one lane
// (one ordered stream, such as a partition), the adapter recalls every one
// handed out after a recalled one too, and recalls the later ones first:
// then a delivery found recalled is never followed by one that runs before
// its redelivery. Deliveries handed out after the recall (the stream given
// back to this consumer) need not be recalled.
//
// Recall is safe to call from any goroutine, any number of times; only the
// first call has an effect. A Source that recalls deliveries should also
// implement [Recaller], so that the runtime gives back at once the recalled
// deliveries that wait for a worker or behind a running job of their lane.
func (d *Delivery) Recall() {
	if d.hasFlag(flagRecalled) {
		return
	}
	d.mu.Lock()
	if !d.hasFlag(flagRecalled) {
		d.setFlag(flagRecalled)
		if d.signals != nil && d.signals.recall != nil {
			close(d.signals.recall)
		}
	}
	d.mu.Unlock()
}

// Recalled reports whether Recall was called. It is a single atomic load,
// cheap enough to check per job.
func (d *Delivery) Recalled() bool { return d.hasFlag(flagRecalled) }

// RecallSignal returns a channel closed when Recall is called (closed
// already if it was). The runtime selects on it while a retry waits in place.
func (d *Delivery) RecallSignal() <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	return madeLocked(&d.signalsLocked().recall, d.hasFlag(flagRecalled))
}

// MarkSettled records that the adapter disposed of the delivery itself (for
// example a native dead-letter reject), so the runtime must not ack it.
func (d *Delivery) MarkSettled() {
	d.mu.Lock()
	d.setFlag(flagSettled)
	d.mu.Unlock()
}

// Settled reports whether MarkSettled was called.
func (d *Delivery) Settled() bool { return d.hasFlag(flagSettled) }

// As sets *target to the native message when target is a non-nil pointer to a
// type the native message is assignable to, and reports whether it did.
func (d *Delivery) As(target any) bool {
	if d.Native == nil || target == nil {
		return false
	}
	v := reflect.ValueOf(target)
	if v.Kind() != reflect.Pointer || v.IsNil() {
		return false
	}
	n := reflect.ValueOf(d.Native)
	if !n.Type().AssignableTo(v.Elem().Type()) {
		return false
	}
	v.Elem().Set(n)
	return true
}
