package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
)

// publisher publishes with publisher confirms and mandatory routing over its
// own connection. Publishing never shares the consumer's connection: a broker
// under a memory or disk alarm blocks publishing connections, and a blocked
// connection would also hold back the consumer's acks.
//
// Publishes are serialised. That keeps a basic.return attributable to the one
// publish in flight (the broker sends it before the confirm, and amqp091
// queues it before it reads the confirm), and retries and dead letters are
// the exceptional path, where one confirm round trip per message is cheap.
type publisher struct {
	s *settings

	mu       sync.Mutex
	conn     *amqp.Connection
	ch       *amqp.Channel
	chClosed chan *amqp.Error
	returns  chan amqp.Return
	user     string // the user the connection authenticated as, if known
	// setup, when set, runs on every new connection before it is used
	// (WithDeclareDeadLetter).
	setup    func(conn *amqp.Connection) error
	declared map[string]bool    // delay queues declared on this broker
	refused  map[string]refusal // delay queues the broker refused to declare
	shut     bool
}

func newPublisher(s *settings) *publisher {
	return &publisher{s: s, declared: map[string]bool{}}
}

// errUnroutable is wrapped when the broker returned a mandatory publish.
var errUnroutable = errors.New("rabbitmq: the broker could not route the message to any queue")

// publish sends msg and returns nil once the broker confirmed it routed to
// at least one queue and stored. A content header frame that would not fit
// the connection's frame_max less reserve bytes for what the broker adds
// (see brokerAdditions) is not sent. fit, if not nil, may first trim msg's
// headers to budget, once the connection and its frame_max are known
// (budget 0: no limit).
func (p *publisher) publish(ctx context.Context, exchange, key string, msg amqp.Publishing, reserve int, fit func(msg *amqp.Publishing, budget, frameMax int)) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.ensureLocked(ctx); err != nil {
		return err
	}
	if msg.UserId != "" && msg.UserId != p.user {
		// RabbitMQ refuses (and closes the channel on) a publish whose
		// user-id is not the publishing connection's user, so a copy of
		// another user's message would never be stored: keep the user-id
		// only as information.
		if msg.Headers == nil {
			msg.Headers = amqp.Table{}
		}
		msg.Headers[HeaderOriginalUserID] = msg.UserId
		msg.UserId = ""
	}
	frameMax, budget := 0, 0
	if p.conn.Config.FrameSize > 0 {
		frameMax = p.conn.Config.FrameSize
		budget = max(frameMax-frameOverhead-reserve, 1)
	}
	if fit != nil {
		fit(&msg, budget, frameMax)
	}
	size, err := headerFrameSize(&msg)
	if err != nil {
		return fmt.Errorf("rabbitmq: publish to exchange %q with routing key %q: %w", exchange, key, err)
	}
	if budget > 0 && size > budget {
		return fmt.Errorf("%w: its content header takes %d bytes; the connection's frame_max of %d leaves %d once room is kept for the %d bytes of headers the broker may add", errHeaderTooLarge, size, frameMax, budget, reserve)
	}
	// A broker that blocks publishers (a resource alarm) stops reading from
	// the connection, and a message larger than the socket buffers then
	// blocks the write itself, where ctx does not reach, until the alarm
	// clears. Ending the connection when ctx ends bounds the publish all the
	// same; its outcome is unknown either way, as after a confirm timeout.
	conn := p.conn
	stop := context.AfterFunc(ctx, func() { _ = conn.CloseDeadline(time.Now()) })
	defer stop()
	dc, err := p.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, msg)
	if err != nil {
		p.resetLocked()
		return fmt.Errorf("rabbitmq: publish to exchange %q with routing key %q: %w", exchange, key, err)
	}
	acked, err := dc.WaitContext(ctx)
	if err != nil {
		// The outcome is unknown and a late return could be taken for the
		// next publish's: start over on a fresh channel.
		p.resetLocked()
		return fmt.Errorf("rabbitmq: waiting for the broker to confirm a publish to exchange %q: %w", exchange, err)
	}
	select {
	case r, ok := <-p.returns:
		if ok {
			if p.setup != nil {
				// Declared routes are declared again on the next
				// connection: start one, so that a retry finds them.
				p.resetLocked()
			}
			return fmt.Errorf("%w: exchange %q, routing key %q: %d %s", errUnroutable, exchange, key, r.ReplyCode, r.ReplyText)
		}
		// Closed with the channel, which the broker closed on refusing
		// the publish: not a basic.return; the nack below says why.
	default:
	}
	if !acked {
		var cause error = errors.New("the broker refused it (basic.nack)")
		select {
		case e := <-p.chClosed:
			if e != nil {
				cause = e
			}
		default:
		}
		p.resetLocked()
		return fmt.Errorf("rabbitmq: publish to exchange %q with routing key %q not confirmed: %w", exchange, key, cause)
	}
	return nil
}

// declareDelayQueue declares, once per publisher, the delay queue name
// whose messages expire after ttl and are dead-lettered to target through
// the default exchange, at least once (see the package documentation,
// section Retries). A declare the broker refuses (a broker older than 3.10,
// which has no message TTL on quorum queues; a user who may not declare
// queues; a queue of that name with other arguments) is not tried again for
// a minute, so that retries meanwhile go to the queue without a failed
// declare, and the new connection it costs, each.
func (p *publisher) declareDelayQueue(ctx context.Context, name string, ttl time.Duration, target string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.declared[name] {
		return nil
	}
	if f, ok := p.refused[name]; ok && time.Since(f.at) < redeclareAfter {
		return fmt.Errorf("%w: %w", errDelayQueueRefused, f.err)
	}
	if err := p.ensureLocked(ctx); err != nil {
		return err
	}
	_, err := p.ch.QueueDeclare(name, true, false, false, false, delayQueueArgs(ttl, target))
	if err != nil {
		p.resetLocked()
		err = fmt.Errorf("rabbitmq: declare delay queue %q (a quorum queue with message TTL: RabbitMQ 3.10 or later): %w (leave out WithDelayQueues if this user may not declare queues)", name, err)
		if p.refused == nil {
			p.refused = map[string]refusal{}
		}
		p.refused[name] = refusal{err: err, at: time.Now()}
		return err
	}
	delete(p.refused, name)
	p.declared[name] = true
	return nil
}

// delayQueueArgs are the arguments of a delay queue. At-least-once
// dead-lettering needs the reject-publish overflow on the dead-lettering
// queue itself.
func delayQueueArgs(ttl time.Duration, target string) amqp.Table {
	return amqp.Table{
		"x-queue-type":              "quorum",
		"x-message-ttl":             ttl.Milliseconds(),
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": target,
		"x-dead-letter-strategy":    "at-least-once",
		"x-overflow":                "reject-publish",
	}
}

// redeclareAfter is how long a delay queue the broker refused to declare is
// not asked for again.
const redeclareAfter = time.Minute

// errDelayQueueRefused is wrapped when a delay queue is not declared because
// the broker refused it less than redeclareAfter ago.
var errDelayQueueRefused = errors.New("rabbitmq: the broker refused this delay queue recently")

type refusal struct {
	err error
	at  time.Time
}

// forget drops a delay queue from the declared cache, after a publish to it
// came back unroutable (someone deleted it).
func (p *publisher) forget(name string) {
	p.mu.Lock()
	delete(p.declared, name)
	p.mu.Unlock()
}

// check runs a passive declare on the publishing channel. A refused one
// closes the channel, so the publisher starts over on a new connection.
func (p *publisher) check(ctx context.Context, declare func(ch *amqp.Channel) error) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.ensureLocked(ctx); err != nil {
		return err
	}
	if err := declare(p.ch); err != nil {
		p.resetLocked()
		return err
	}
	return nil
}

func (p *publisher) ensureLocked(ctx context.Context) error {
	if p.shut {
		return adapters.ErrClosed
	}
	if p.ch != nil && !p.ch.IsClosed() && !p.conn.IsClosed() {
		return nil
	}
	p.resetLocked()
	conn, err := p.s.dial(ctx)
	if err != nil {
		return err
	}
	// Opening the channel waits for the broker with no context of its own:
	// ending ctx closes the connection, which ends the wait, so that a
	// broker that does not answer cannot hold a Nack or a Send past it.
	stop := context.AfterFunc(ctx, func() { _ = conn.CloseDeadline(time.Now()) })
	if p.setup != nil {
		err = p.setup(conn)
	}
	var ch *amqp.Channel
	if err == nil {
		if ch, err = conn.Channel(); err == nil {
			err = ch.Confirm(false)
		}
		if err != nil {
			err = fmt.Errorf("rabbitmq: open a publishing channel: %w", err)
		}
	}
	if !stop() {
		err = fmt.Errorf("rabbitmq: open a publishing channel: %w", ctx.Err())
	}
	if err != nil {
		_ = conn.CloseDeadline(time.Now().Add(p.s.closeTimeout))
		return err
	}
	p.conn, p.ch = conn, ch
	p.user = connUser(conn)
	// Buffered for the one close error and the one return that can be
	// outstanding: amqp091 never blocks on them, and nothing else listens.
	p.chClosed = ch.NotifyClose(make(chan *amqp.Error, 1))
	p.returns = ch.NotifyReturn(make(chan amqp.Return, 1))
	return nil
}

// connUser returns the user conn authenticated as with a username and
// password, or "" when it may have used another mechanism (EXTERNAL: a
// certificate). amqp091 uses the first of its mechanisms the broker
// supports, and RabbitMQ supports both of these.
func connUser(conn *amqp.Connection) string {
	for _, a := range conn.Config.SASL {
		switch a := a.(type) {
		case *amqp.PlainAuth:
			return a.Username
		case *amqp.AMQPlainAuth:
			return a.Username
		default:
			return ""
		}
	}
	return ""
}

func (p *publisher) resetLocked() {
	if p.conn != nil {
		_ = p.conn.CloseDeadline(time.Now().Add(p.s.closeTimeout))
	}
	p.conn, p.ch, p.chClosed, p.returns = nil, nil, nil, nil
}

func (p *publisher) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.resetLocked()
	p.shut = true
}
