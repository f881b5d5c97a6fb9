package memory

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/custody-go/custody/adapters"
)

// DeadLetterQueue is an adapters.DeadLetter that publishes into a memory
// queue: the original body, key and headers plus the diagnostic headers of
// adapters.Diagnostics. Diagnostic headers the original already carried (it
// was dead-lettered before and replayed) are replaced, not kept beside the
// new ones.
type DeadLetterQueue struct {
	b     *Broker
	queue string

	mu   sync.Mutex
	fail func(d *adapters.Delivery) error
}

// DeadLetterQueue returns a dead-letter destination that publishes into the
// named queue, which must exist.
func (b *Broker) DeadLetterQueue(queueName string) (*DeadLetterQueue, error) {
	if _, ok := b.lookup(queueName); !ok {
		return nil, fmt.Errorf("memory: DeadLetterQueue(%q): %w", queueName, ErrNoQueue)
	}
	return &DeadLetterQueue{b: b, queue: queueName}, nil
}

// SetFault makes Send fail for deliveries fail returns an error for; nil
// removes the fault.
func (q *DeadLetterQueue) SetFault(fail func(d *adapters.Delivery) error) {
	q.mu.Lock()
	q.fail = fail
	q.mu.Unlock()
}

// Send implements adapters.DeadLetter. The write is durable (in this
// process's terms) when Send returns nil: the queue holds its own copy of the
// body.
func (q *DeadLetterQueue) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	q.mu.Lock()
	fail := q.fail
	q.mu.Unlock()
	if fail != nil {
		if err := fail(d); err != nil {
			return err
		}
	}
	h := withoutDiagnostics(d.Headers)
	maps.Copy(h, adapters.Diagnostics(d, f))
	// Durable means the caller may reuse its buffer once Send returns, as
	// after Publish.
	body := bytes.Clone(d.Body)
	q.b.mu.Lock()
	defer q.b.mu.Unlock()
	dst, ok := q.b.queues[q.queue]
	if !ok {
		return fmt.Errorf("memory: dead-letter queue %q: %w", q.queue, ErrNoQueue)
	}
	q.b.publishLocked(dst, Message{ID: d.ID, Body: body, Headers: h, Key: d.Key}, time.Now())
	return nil
}
