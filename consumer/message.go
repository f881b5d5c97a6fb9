package consumer

import (
	"time"

	"github.com/custody-go/custody/adapters"
)

// Message is one delivery of a message, as the handler sees it. The handler
// must not modify Body or Headers.
type Message struct {
	// ID is the broker's identity of the message, stable across
	// redeliveries where the broker has one (SQS MessageId, AMQP
	// message-id, Kafka topic/partition/offset).
	ID string
	// Body is the payload.
	Body []byte
	// Headers are the message's attributes or headers.
	Headers map[string]string
	// Key is the message's own key (Kafka record key, SQS FIFO group id).
	Key string
	// Attempt counts deliveries of this message, 1 on the first. It comes
	// from the broker where the broker counts; otherwise from this runtime,
	// which cannot see attempts made by other processes.
	Attempt int
	// Queue is the queue or topic the message came from; Partition and
	// Offset locate a Kafka record (-1 elsewhere).
	Queue     string
	Partition int32
	// batchPos is the message's position in batch (below). It sits beside
	// Partition, in what would otherwise be padding: a Message is allocated
	// with every job. WithBatchSize bounds it far below MaxInt32.
	batchPos int32
	Offset   int64
	// PublishedAt is when the broker accepted the message, if it says;
	// ReceivedAt is when this consumer received it.
	PublishedAt time.Time
	ReceivedAt  time.Time

	d *adapters.Delivery
	// batch and batchPos place the message in the runtime's batch, if it
	// is handled in one.
	batch *Batch
}

func fillMessage(m *Message, d *adapters.Delivery, attempt int) {
	*m = Message{
		ID:          d.ID,
		Body:        d.Body,
		Headers:     d.Headers,
		Key:         d.Key,
		Attempt:     attempt,
		Queue:       d.Queue,
		Partition:   d.Partition,
		Offset:      d.Offset,
		PublishedAt: d.PublishedAt,
		ReceivedAt:  d.ReceivedAt,
		d:           d,
	}
}

// As sets target to the broker's native message when target is a pointer to
// its type (for example *types.Message for SQS, *amqp091.Delivery for
// RabbitMQ, **kgo.Record for Kafka), and reports whether it did.
func (m *Message) As(target any) bool {
	if m.d == nil {
		return false
	}
	return m.d.As(target)
}
