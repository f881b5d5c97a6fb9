package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
)

// DeadLetter is a dead-letter sink that publishes each failed message to an
// exchange, with publisher confirms, over its own connection. It implements
// adapters.DeadLetter for deliveries of any adapter. Send returns nil only
// once the broker confirmed the copy routed and stored, so the runtime acks
// the original only then. What the copy keeps, sets aside and leaves out is
// in the package documentation, section Dead letters.
type DeadLetter struct {
	exchange, key string
	pub           *publisher
	reserve       int // room kept for the headers the broker adds (brokerAdditions)
	tel           *telemetry
}

// NewDeadLetter connects and checks that exchange exists ("" is the default
// exchange, which routes by queue name: then that the queue routingKey
// exists), so that a wrong name fails here rather than at the first poison
// message. AMQP does not show bindings: a named exchange that routes
// routingKey nowhere fails the first Send (the original is kept).
// WithDeclareDeadLetter declares the exchange, the queue and the binding
// instead. The connection options, WithLogger and WithMeterProvider apply.
func NewDeadLetter(ctx context.Context, exchange, routingKey string, opts ...Option) (*DeadLetter, error) {
	st, err := applyFor("NewDeadLetter", opts)
	if err != nil {
		return nil, err
	}
	if exchange == "" && routingKey == "" {
		return nil, errors.New("rabbitmq: NewDeadLetter: with the default exchange the routing key names the dead-letter queue and must not be empty")
	}
	if err := checkShortstr("NewDeadLetter", "exchange name", exchange); err != nil {
		return nil, err
	}
	if err := checkShortstr("NewDeadLetter", "routing key", routingKey); err != nil {
		return nil, err
	}
	dlq := "" // unknown behind a named exchange
	if exchange == "" {
		dlq = routingKey
	}
	tel, err := sinkTelemetry(st.meters, exchange, routingKey)
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: NewDeadLetter: telemetry: %w", err)
	}
	x := &DeadLetter{exchange: exchange, key: routingKey, pub: newPublisher(st), reserve: brokerAdditions(dlq, exchange, routingKey), tel: tel}
	if dd := st.deadLetterDeclare; dd != nil {
		switch {
		case exchange == "" && dd.queue == "":
			dd.queue = routingKey
		case exchange == "" && dd.queue != routingKey:
			return nil, fmt.Errorf("rabbitmq: WithDeclareDeadLetter(%q): with the default exchange the routing key %q names the queue; leave the queue name empty or make it the routing key", dd.queue, routingKey)
		case dd.queue == "":
			return nil, fmt.Errorf("rabbitmq: WithDeclareDeadLetter: the queue name is empty; name the queue to bind to exchange %q", exchange)
		}
		if err := checkShortstr("WithDeclareDeadLetter", "queue name", dd.queue); err != nil {
			return nil, err
		}
		x.pub.setup = func(conn *amqp.Connection) error { return dd.declare(conn, exchange, routingKey) }
	}
	err = x.pub.check(ctx, func(ch *amqp.Channel) error {
		if exchange != "" {
			if err := ch.ExchangeDeclarePassive(exchange, "direct", true, false, false, false, nil); err != nil {
				return fmt.Errorf("rabbitmq: dead-letter exchange %q: %w (declare it and bind the dead-letter queue to it, or let the sink declare both and the binding with WithDeclareDeadLetter)", exchange, err)
			}
			return nil
		}
		// The default exchange routes by queue name: the queue must exist.
		if _, err := ch.QueueDeclarePassive(routingKey, true, false, false, false, nil); err != nil {
			return fmt.Errorf("rabbitmq: dead-letter queue %q: %w (declare it first, or let the sink declare it with WithDeclareDeadLetter)", routingKey, err)
		}
		return nil
	})
	if err != nil {
		x.pub.close()
		return nil, err
	}
	return x, nil
}

// deadLetterDeclare is what WithDeclareDeadLetter asks to declare.
type deadLetterDeclare struct {
	queue string
	typ   QueueType
	args  amqp.Table
}

// WithDeclareDeadLetter makes NewDeadLetter declare where its dead
// letters go, on its first connection and again on every new one (after a
// lost connection, or a copy the broker could not route): the exchange,
// durable and direct, unless it is the default exchange or already exists
// (of any type); the queue, durable, of type t with args (CheckQueue only
// checks that it exists; see WithDeclare for the arguments); and a binding
// of the queue to the exchange with the sink's routing key. With the
// default exchange the routing key names the queue: leave queue empty (or
// give the same name). Only for NewDeadLetter; a Source's queue is
// declared with WithDeclare.
//
//	dlq, err := rabbitmq.NewDeadLetter(ctx, "orders.dlx", "orders", rabbitmq.WithURL(url),
//		rabbitmq.WithDeclareDeadLetter("orders.dlq", rabbitmq.QuorumQueue, nil))
func WithDeclareDeadLetter(queue string, t QueueType, args amqp.Table) Option {
	return func(s *settings) error {
		s.only("NewDeadLetter", "WithDeclareDeadLetter")
		all, err := declareArgs("WithDeclareDeadLetter", t, args)
		if err != nil {
			return err
		}
		s.deadLetterDeclare = &deadLetterDeclare{queue: queue, typ: t, args: all}
		return nil
	}
}

// declare declares the exchange, the queue and their binding on a channel
// of its own, since a refused declare closes the channel it was made on.
func (dd *deadLetterDeclare) declare(conn *amqp.Connection, exchange, key string) error {
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer func() { _ = ch.Close() }()
	if exchange != "" {
		if err := ch.ExchangeDeclarePassive(exchange, "direct", true, false, false, false, nil); err != nil {
			var e *amqp.Error
			if !errors.As(err, &e) || e.Code != amqp.NotFound {
				return fmt.Errorf("rabbitmq: dead-letter exchange %q: %w", exchange, err)
			}
			if ch, err = conn.Channel(); err != nil {
				return err
			}
			if err := ch.ExchangeDeclare(exchange, amqp.ExchangeDirect, true, false, false, false, nil); err != nil {
				return fmt.Errorf("rabbitmq: declare dead-letter exchange %q: %w", exchange, err)
			}
		}
	}
	if dd.typ == CheckQueue {
		if _, err := ch.QueueDeclarePassive(dd.queue, true, false, false, false, nil); err != nil {
			return fmt.Errorf("rabbitmq: dead-letter queue %q: %w (declare it first, or give WithDeclareDeadLetter a queue type)", dd.queue, err)
		}
	} else if _, err := ch.QueueDeclare(dd.queue, true, false, false, false, dd.args); err != nil {
		return fmt.Errorf("rabbitmq: declare %s dead-letter queue %q: %w (an existing queue must have the same type and arguments)", dd.typ, dd.queue, err)
	}
	if exchange != "" {
		if err := ch.QueueBind(dd.queue, key, exchange, false, nil); err != nil {
			return fmt.Errorf("rabbitmq: bind dead-letter queue %q to exchange %q with routing key %q: %w", dd.queue, exchange, key, err)
		}
	}
	return nil
}

// Send implements adapters.DeadLetter.
func (x *DeadLetter) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	var p amqp.Publishing
	exchange, key := "", d.Queue
	if m, ok := d.Native.(amqp.Delivery); ok {
		// The route first: originalRoute reads HeaderOriginalExchange,
		// which retries keep and dropDiagnostics removes.
		exchange, key = originalRoute(&m)
		p = republishing(&m)
		dropDiagnostics(p.Headers)
		if xd, ok := m.Headers["x-death"]; ok {
			// The broker's own history is diagnostics too; anything else
			// under that name would be lost, or lose the copy, when the
			// dead-letter queue dead-letters it in turn.
			if isXDeath(xd) {
				p.Headers["x-death"] = xd
			} else {
				p.Headers[HeaderOriginalXDeath] = xd
			}
		}
	} else {
		p = amqp.Publishing{Headers: foreignHeaders(d.Headers), Body: d.Body, Timestamp: d.PublishedAt}
		if len(d.ID) <= maxShortstr {
			// A longer id does not fit the message-id property (a short
			// string); HeaderOriginalID carries it in full either way.
			p.MessageId = d.ID
		}
	}
	p.DeliveryMode = amqp.Persistent
	// The retry counter is this queue's bookkeeping, not the message's: a
	// copy replayed from the dead-letter queue starts its attempts afresh
	// (custody-attempts keeps the count as a diagnostic).
	delete(p.Headers, HeaderAttempt)
	for k, v := range adapters.Diagnostics(d, f) {
		p.Headers[k] = v
	}
	p.Headers[HeaderOriginalExchange] = exchange
	p.Headers[HeaderOriginalRoutingKey] = key
	start := time.Now()
	err := x.pub.publish(ctx, x.exchange, x.key, p, x.reserve, fitDeadLetter)
	x.tel.published(copyDeadLetter, time.Since(start), err != nil)
	if err != nil {
		return fmt.Errorf("rabbitmq: dead-letter message %q: %w", d.ID, err)
	}
	return nil
}

// Close closes the sink's connection.
func (x *DeadLetter) Close() error {
	x.pub.close()
	return nil
}

// NativeDeadLetter returns a dead-letter destination that rejects a failed
// delivery without requeue (basic.nack, requeue=false), so the broker moves
// it to the queue's own dead-letter exchange, adding x-death. It settles the
// original (adapters.OriginalSettler); the error and attempts are only
// logged, and nothing confirms the move (see the package documentation,
// section Dead letters). It fails unless the queue has a known dead-letter
// exchange: an x-dead-letter-exchange argument (WithDeclare) or a policy
// (WithDeadLetterByPolicy).
func (s *Source) NativeDeadLetter() (adapters.DeadLetter, error) {
	if _, ok := s.s.queueArgs["x-dead-letter-exchange"]; !ok && !s.s.dlxByPolicy {
		return nil, fmt.Errorf("rabbitmq: NativeDeadLetter: queue %q has no known dead-letter exchange, so rejected messages would be discarded; declare it with an x-dead-letter-exchange argument (WithDeclare) or, if a policy sets one, say so with WithDeadLetterByPolicy", s.queue)
	}
	return nativeDeadLetter{s}, nil
}

type nativeDeadLetter struct{ s *Source }

// SettlesOriginal reports that Send disposes of the original itself (the
// reject is the move), so the runtime does not ack it.
func (nativeDeadLetter) SettlesOriginal(*adapters.Delivery) bool { return true }

func (n nativeDeadLetter) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	h, err := n.s.own(d)
	if err != nil {
		return err
	}
	g := h.gen
	g.mu.Lock()
	err = g.rejectLocked(h, false)
	if err == nil {
		h.disposed = true
	}
	g.mu.Unlock()
	if err != nil {
		return fmt.Errorf("rabbitmq: reject message %q into the dead-letter exchange: %w", d.ID, err)
	}
	var cause string
	if f.Err != nil {
		cause = f.Err.Error()
	}
	n.s.s.logger.Warn("rabbitmq: rejected a message into the queue's dead-letter exchange",
		"queue", n.s.queue, "id", d.ID, "attempts", f.Attempts, "permanent", f.Permanent, "error", cause,
		"last_failure", f.LastFailure.Format(time.RFC3339))
	return nil
}
