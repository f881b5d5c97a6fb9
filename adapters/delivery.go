package adapters

import (
	"reflect"
	"time"
)

// Delivery is one received message: plain data the adapter fills and the
// runtime reads (and, but for a nil Signal, never changes). A Delivery is
// handed to the runtime once and stays in the adapter's bookkeeping until it
// is acked, nacked or lost. Handlers never see it: they get a
// consumer.Message, whose As method reaches the native message.
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
	// ReceivedAt is when this delivery was received. The runtime counts
	// the lease it keeps alive, and the cap on the total hold time
	// (Capabilities.MaxLeaseAge), from it.
	ReceivedAt time.Time

	// Native is the broker's own message (for As). Adapters document its
	// type.
	Native any
	// Handle is adapter-private state: a receipt handle, a delivery tag and
	// channel generation, an assignment epoch. The runtime never reads it.
	Handle any

	// Signal is how the adapter tells the runtime that it lost the
	// delivery, or wants it back, outside the results of Ack, Nack and
	// Extend (see [Signal]). An adapter that never does leaves it nil, and
	// the runtime, which loses deliveries too (a lease it could not
	// renew), puts a Signal of its own here when it takes the delivery.
	Signal *Signal
}

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
