package rabbitmq

import (
	"context"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
)

var _ adapters.BacklogReporter = (*Source)(nil)

// Backlog implements adapters.BacklogReporter with a passive queue.declare
// on a channel opened for the call on the consuming connection, which never
// publishes, so a broker blocking publishers does not hold it back; a
// refused declare closes only that channel.
// Waiting is the queue's ready messages, without those delivered and not yet
// acked or waiting in delay queues; InFlight is -1 and OldestAge zero, which
// AMQP does not tell (see the package documentation, section Backlog).
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
