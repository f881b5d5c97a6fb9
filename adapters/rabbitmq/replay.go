package rabbitmq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/pace"
)

// Replay lists the dead letters in a RabbitMQ queue and moves a selection of
// them back to the queues they came from; create it with NewReplay. Its
// methods are safe for concurrent use: each call reads the dead-letter queue
// over a connection of its own, and copies go out one at a time over the
// replay's publishing connection. It reads what a DeadLetter sink wrote and
// what the broker dead-lettered itself (x-death, x-first-death-*). A dead
// letter's ID is a digest of its properties, headers and body (RabbitMQ
// gives a message no id of its own): the same on every delivery of the dead
// letter, different between two dead-letter copies of one message. Its
// OriginalID is the message-id.
type Replay struct {
	s     *settings
	queue string
	pub   *publisher
	tel   *telemetry

	// testHookConfirmed, when set by a test, runs between a copy's confirm
	// and its dead letter's ack, with the connection the dead letter was read
	// on.
	testHookConfirmed func(conn *amqp.Connection)
}

// NewReplay connects, checks that the dead-letter queue exists, and returns
// a Replay of it. The connection options, WithLogger, WithMeterProvider and
// WithReplayThroughExchange apply. Close it when done.
func NewReplay(ctx context.Context, queue string, opts ...Option) (*Replay, error) {
	if queue == "" {
		return nil, errors.New("rabbitmq: NewReplay: the dead-letter queue name is empty")
	}
	if err := checkShortstr("NewReplay", "queue name", queue); err != nil {
		return nil, err
	}
	st, err := applyFor("NewReplay", opts)
	if err != nil {
		return nil, err
	}
	tel, err := queueTelemetry(st.meters, queue)
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: NewReplay: telemetry: %w", err)
	}
	r := &Replay{s: st, queue: queue, pub: newPublisher(st), tel: tel}
	conn, _, err := r.open(ctx)
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: NewReplay: %w", err)
	}
	_ = conn.CloseDeadline(time.Now().Add(st.closeTimeout))
	return r, nil
}

// WithReplayThroughExchange makes a Replay publish each copy through the
// exchange and routing key its message was first published with
// (custody-original-exchange and custody-original-routing-key, or for a
// dead letter the broker made, the exchange and first routing key of its
// first death), as a new publish would. The copy then reaches every queue
// that route is bound to now, not only the queue whose consumer failed:
// with a fanout or topic exchange, consumers that handled the message the
// first time get it again. Default: off; each copy goes through the default
// exchange to its original queue alone. Only for NewReplay.
func WithReplayThroughExchange() Option {
	return func(s *settings) error {
		s.only("NewReplay", "WithReplayThroughExchange")
		s.replayThroughExchange = true
		return nil
	}
}

// Close closes the replay's publishing connection.
func (r *Replay) Close() error {
	r.pub.close()
	return nil
}

// open dials a connection for one call, opens a channel on it and checks
// that the dead-letter queue exists, returning its declare-ok.
func (r *Replay) open(ctx context.Context) (*amqp.Connection, *amqp.Channel, error) {
	conn, err := r.s.dial(ctx)
	if err != nil {
		return nil, nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		_ = conn.CloseDeadline(time.Now().Add(r.s.closeTimeout))
		return nil, nil, fmt.Errorf("open a channel: %w", err)
	}
	if _, err := ch.QueueDeclarePassive(r.queue, true, false, false, false, nil); err != nil {
		_ = conn.CloseDeadline(time.Now().Add(r.s.closeTimeout))
		return nil, nil, fmt.Errorf("dead-letter queue %q: %w (check the name)", r.queue, err)
	}
	return conn, ch, nil
}

// call runs f with a connection and channel of its own, ending the
// connection when ctx ends (amqp091's calls take no context) and when f
// returns; the broker then takes back every dead letter f read and did not
// ack. A connection error that ctx's end caused is reported as ctx's error.
func (r *Replay) call(ctx context.Context, f func(conn *amqp.Connection, ch *amqp.Channel) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	conn, ch, err := r.open(ctx)
	if err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.CloseDeadline(time.Now()) })
	err = f(conn, ch)
	if stop() {
		// Closing the channel first, and waiting for the broker's answer,
		// hands every unacked dead letter back before the call returns; a
		// broker that does not answer has the connection closed instead,
		// which hands them back too.
		late := time.AfterFunc(r.s.closeTimeout, func() { _ = conn.CloseDeadline(time.Now()) })
		_ = ch.Close()
		late.Stop()
	} else if err != nil {
		err = fmt.Errorf("%w (%v)", ctx.Err(), err)
	}
	_ = conn.CloseDeadline(time.Now().Add(r.s.closeTimeout))
	return err
}

// List returns up to max of the queue's dead letters, from its head, with
// their diagnostics: a dry run that removes nothing. It reads them with
// basic.get without acking, then closes its channel, and the broker takes
// them back, each flagged redelivered; on a quorum queue its
// x-delivery-count grows by one (which counts towards an x-delivery-limit of
// the dead-letter queue), and the messages taken back are delivered ahead of
// the others but behind those taken back before them, so a List of fewer
// messages than an earlier one moves those it read behind the rest of the
// earlier one's. A classic queue puts them back where they were. Messages
// another consumer holds are not seen.
func (r *Replay) List(ctx context.Context, max int) ([]adapters.DeadLetterRecord, error) {
	if max < 1 {
		return nil, fmt.Errorf("rabbitmq: Replay.List(max=%d): max must be at least 1", max)
	}
	var out []adapters.DeadLetterRecord
	err := r.call(ctx, func(_ *amqp.Connection, ch *amqp.Channel) error {
		for len(out) < max {
			m, ok, err := ch.Get(r.queue, false)
			if err != nil {
				return fmt.Errorf("basic.get: %w", err)
			}
			if !ok {
				return nil
			}
			out = append(out, readDeadLetter(&m).rec)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: Replay.List of queue %q: %w", r.queue, err)
	}
	return out, nil
}

// Replay moves the dead letters o selects, up to o.Max, back where they came
// from, at most o.Rate a second, in the order the queue delivers them (see
// List). A run reads at most the messages the queue held when it began, so
// a copy dead-lettered again during the run is not replayed again by it.
//
// For each dead letter it publishes a copy, persistent, mandatory and with
// publisher confirms, through the default exchange to its original queue
// (custody-original-queue, or x-first-death-queue), or with
// WithReplayThroughExchange through its original exchange and routing key.
// Only once the broker confirmed the copy routed and stored does it ack the
// dead letter, and it waits for the broker to have read that ack before it
// counts the dead letter replayed. The copy keeps the dead letter's body,
// properties and headers, less the diagnostics and the broker's own headers,
// with adapters.HeaderReplayOf set to the dead letter's ID and, when
// o.KeepDiagnostics, the diagnostics as a JSON object in
// adapters.HeaderReplayDiagnostics. Its message-id is the dead letter's, or
// the dead letter's ID when it has none.
//
// Dead letters o.Select leaves out are held by the run's channel until it
// ends, then taken back by the broker as after List (a run that holds one
// past the broker's consumer_timeout fails, and the broker takes back what
// it held). The run stops at the first error (an unroutable copy, one the
// broker refuses or does not confirm, a dead letter that names no original
// queue, a lost connection, ctx's end), leaving in the queue the dead letter
// it was at and every one after it.
//
// RabbitMQ does not deduplicate publishes, and nothing in AMQP ties a copy's
// confirm to the dead letter's ack: a run that ends between the two leaves
// the dead letter in the queue with its copy possibly stored, and the next
// run publishes it again. A run has at most one dead letter in that state,
// so each run cut short leaves at most one duplicate, with the same
// message-id and HeaderReplayOf, which the idempotency middleware absorbs.
// ReplayResult.Skipped counts only what Select left out: a dead letter
// replayed before cannot be recognised as such.
func (r *Replay) Replay(ctx context.Context, o adapters.ReplayOptions) (adapters.ReplayResult, error) {
	var res adapters.ReplayResult
	p, err := pace.ForReplay(o.Rate, o.Max)
	if err != nil {
		return res, fmt.Errorf("rabbitmq: Replay: %w", err)
	}
	err = r.call(ctx, func(conn *amqp.Connection, ch *amqp.Channel) error {
		q, err := ch.QueueDeclarePassive(r.queue, true, false, false, false, nil)
		if err != nil {
			return fmt.Errorf("passive declare: %w", err)
		}
		for range q.Messages {
			if o.Max > 0 && res.Replayed >= o.Max {
				return nil
			}
			m, ok, err := ch.Get(r.queue, false)
			if err != nil {
				return fmt.Errorf("basic.get: %w", err)
			}
			if !ok {
				return nil
			}
			dl := readDeadLetter(&m)
			if o.Select != nil && !o.Select(dl.rec) {
				res.Skipped++
				continue // held until the channel closes, then put back
			}
			if err := p.Wait(ctx); err != nil {
				return err
			}
			if err := r.publishCopy(ctx, dl, o.KeepDiagnostics); err != nil {
				return fmt.Errorf("dead letter %s (message-id %q) stays in the queue: %w", dl.rec.ID, m.MessageId, err)
			}
			if r.testHookConfirmed != nil {
				r.testHookConfirmed(conn)
			}
			if err := removeDeadLetter(ch, m.DeliveryTag); err != nil {
				return fmt.Errorf("dead letter %s (message-id %q): its copy is confirmed, but its removal was cut short, so it stays in the queue and the next run publishes it again (the same message-id and %s): %w",
					dl.rec.ID, m.MessageId, adapters.HeaderReplayOf, err)
			}
			res.Replayed++
		}
		return nil
	})
	if err != nil {
		return res, fmt.Errorf("rabbitmq: Replay of queue %q (%d replayed before): %w", r.queue, res.Replayed, err)
	}
	return res, nil
}

// removeDeadLetter acks tag and returns once the broker has read the ack:
// acks have no answer, but a channel's methods are handled in order, so the
// answer to a basic.qos sent after it follows it.
func removeDeadLetter(ch *amqp.Channel, tag uint64) error {
	if err := ch.Ack(tag, false); err != nil {
		return fmt.Errorf("basic.ack: %w", err)
	}
	if err := ch.Qos(0, 0, false); err != nil {
		return fmt.Errorf("waiting for the broker to read the ack: %w", err)
	}
	return nil
}

// publishCopy publishes dl's copy to its original destination and returns
// once the broker confirmed it routed and stored.
func (r *Replay) publishCopy(ctx context.Context, dl deadLetter, keep bool) error {
	exchange, key := "", dl.rec.OriginalQueue
	if r.s.replayThroughExchange {
		if !dl.routed {
			return fmt.Errorf("it records no original exchange and routing key (%s and %s, or the broker's x-death) to replay it through (WithReplayThroughExchange); leave it out with ReplayOptions.Select",
				adapters.HeaderOriginalExchange, adapters.HeaderOriginalRoutingKey)
		}
		exchange, key = dl.exchange, dl.key
	} else if key == "" {
		return fmt.Errorf("it names no original queue (no %s header, nor x-first-death-queue); leave it out with ReplayOptions.Select",
			adapters.HeaderOriginalQueue)
	}
	msg := replayCopy(dl.msg)
	msg.Headers[adapters.HeaderReplayOf] = dl.rec.ID
	if msg.MessageId == "" {
		msg.MessageId = dl.rec.ID
	}
	if keep {
		js, err := json.Marshal(dl.rec.Diagnostics)
		if err != nil {
			return fmt.Errorf("packing its diagnostics: %w", err)
		}
		msg.Headers[adapters.HeaderReplayDiagnostics] = string(js)
	}
	queue := ""
	if exchange == "" {
		queue = key
	}
	start := time.Now()
	err := r.pub.publish(ctx, exchange, key, msg, brokerAdditions(queue, exchange, key), nil)
	r.tel.published(copyReplay, time.Since(start), err != nil)
	return err
}

// replayCopy copies a dead letter into the publishing that replays it,
// persistent, without the diagnostics and an earlier replay's headers.
func replayCopy(m *amqp.Delivery) amqp.Publishing {
	p := copyOf(m)
	dropDiagnostics(p.Headers)
	delete(p.Headers, adapters.HeaderReplayOf)
	delete(p.Headers, adapters.HeaderReplayDiagnostics)
	p.DeliveryMode = amqp.Persistent
	return p
}
