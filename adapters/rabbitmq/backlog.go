package rabbitmq

import (
	"context"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
)

var _ adapters.BacklogReporter = (*Source)(nil)

// Backlog implements adapters.BacklogReporter with a passive queue.declare
// of the Source's queue, on a channel of its own opened on the consuming
// connection for the call (a refused declare closes the channel it was made
// on; the consuming channel stays out of it, and the consuming connection,
// which never publishes, is not held back when the broker blocks publishers).
//
// Waiting is the queue's ready messages, as the broker counts them in its
// declare-ok: messages delivered to a consumer and not yet acked are not in
// it, and neither are retries waiting in delay queues (WithDelayQueues),
// which are in queues of their own until they expire back. InFlight is -1:
// AMQP 0-9-1 does not tell the unacked count of a queue; only the management
// API (messages_unacknowledged) and rabbitmqctl do. This consumer's own
// share is the runtime's Status().Held and custody.messages.in_flight.
// OldestAge stays zero: AMQP tells the age of no message without reading
// it (the management API's head_message_timestamp does, for classic queues
// whose messages carry a timestamp property).
//
// It fails with adapters.ErrConnectionLost while the Source reconnects,
// adapters.ErrClosed once it is closed, and ctx's error if ctx ends first
// (the declare, which amqp091 waits for without a context, then ends with
// its connection at the latest).
func (s *Source) Backlog(ctx context.Context) (adapters.Backlog, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return adapters.Backlog{}, adapters.ErrClosed
	}
	g := s.gen
	if g == nil {
		s.mu.Unlock()
		return adapters.Backlog{}, fmt.Errorf("rabbitmq: backlog of queue %q: %w (reconnecting)", s.queue, adapters.ErrConnectionLost)
	}
	s.wg.Add(1)
	s.mu.Unlock()
	type result struct {
		q   amqp.Queue
		err error
	}
	done := make(chan result, 1)
	go func() {
		defer s.wg.Done()
		q, err := declarePassive(g.conn, s.queue)
		done <- result{q, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			return adapters.Backlog{}, fmt.Errorf("rabbitmq: backlog of queue %q: %w", s.queue, r.err)
		}
		return adapters.Backlog{Waiting: int64(r.q.Messages), InFlight: -1}, nil
	case <-ctx.Done():
		return adapters.Backlog{}, fmt.Errorf("rabbitmq: backlog of queue %q: %w", s.queue, ctx.Err())
	case <-s.closing:
		return adapters.Backlog{}, adapters.ErrClosed
	}
}

// declarePassive asks the broker for queue's counts on a channel of its own.
func declarePassive(conn *amqp.Connection, queue string) (amqp.Queue, error) {
	ch, err := conn.Channel()
	if err != nil {
		return amqp.Queue{}, fmt.Errorf("open a channel: %w", err)
	}
	defer func() { _ = ch.Close() }()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return amqp.Queue{}, fmt.Errorf("passive declare: %w", err)
	}
	return q, nil
}
