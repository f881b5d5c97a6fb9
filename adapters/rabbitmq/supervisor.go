package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/backoff"
	"github.com/custody-go/custody/internal/prefix"
)

// connect opens one generation: connection, channel, queue check or
// declaration, QoS, notifications and the consumer.
func (s *Source) connect(ctx context.Context) (*generation, error) {
	conn, err := s.s.dial(ctx)
	if err != nil {
		return nil, err
	}
	// Opening the channel and the consumer waits for the broker's answers
	// with no context of its own: ending ctx (Close during a reconnect, the
	// handshake timeout) closes the connection, which ends those waits.
	stop := context.AfterFunc(ctx, func() { _ = conn.CloseDeadline(time.Now()) })
	g, err := s.open(conn)
	if !stop() && err == nil {
		err = fmt.Errorf("rabbitmq: open a channel: %w", ctx.Err())
	}
	if err != nil {
		_ = conn.CloseDeadline(time.Now().Add(s.s.closeTimeout))
		return nil, err
	}
	return g, nil
}

func (s *Source) open(conn *amqp.Connection) (*generation, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: open a channel: %w", err)
	}
	switch s.s.queueType {
	case CheckQueue:
		if _, err := ch.QueueDeclarePassive(s.queue, true, false, false, false, nil); err != nil {
			return nil, fmt.Errorf("rabbitmq: queue %q: %w (declare it first, or let the adapter declare it with WithDeclare)", s.queue, err)
		}
	default:
		if _, err := ch.QueueDeclare(s.queue, true, false, false, false, s.s.queueArgs); err != nil {
			return nil, fmt.Errorf("rabbitmq: declare %s queue %q: %w (an existing queue must have the same type and arguments)", s.s.queueType, s.queue, err)
		}
	}
	if err := ch.Qos(s.s.prefetch, 0, false); err != nil {
		return nil, fmt.Errorf("rabbitmq: set prefetch %d: %w", s.s.prefetch, err)
	}
	g := &generation{
		src:     s,
		conn:    conn,
		ch:      ch,
		pumped:  make(chan struct{}),
		stopped: make(chan struct{}),
		tracker: prefix.New(),
		held:    make(map[uint64]*adapters.Delivery, s.s.prefetch),
	}
	// Each notification channel is buffered for everything amqp091 can send
	// on it (one close error; one cancel, there being one consumer), so the
	// library never waits on us, and the supervisor reads them.
	g.connClosed = conn.NotifyClose(make(chan *amqp.Error, 1))
	g.chClosed = ch.NotifyClose(make(chan *amqp.Error, 1))
	g.cancelled = ch.NotifyCancel(make(chan string, 1))
	msgs, err := ch.Consume(s.queue, s.tag, false, false, false, false, nil)
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: consume queue %q: %w", s.queue, err)
	}
	g.msgs = msgs
	return g, nil
}

// install makes g the current generation and starts its pump. When the
// Source closed meanwhile, it shuts g down instead and reports false.
func (s *Source) install(g *generation) bool {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		g.die()
		_ = g.conn.CloseDeadline(time.Now().Add(s.s.closeTimeout))
		return false
	}
	s.genSeq++
	g.id = s.genSeq
	s.gen = g
	s.lastDialErr, s.dialErrKind, s.dialErrNew = nil, "", false
	s.setConnLocked(adapters.Connected, nil)
	s.wg.Add(1)
	s.mu.Unlock()
	s.stats.generations.Add(1)
	go g.pump()
	return true
}

// supervise watches the current generation and replaces it when it dies,
// until the Source closes.
func (s *Source) supervise(g *generation) {
	defer s.wg.Done()
	health := time.NewTicker(max(time.Second, s.s.consumerTimeout/8))
	defer health.Stop()
	// flaps counts the generations in a row that died within the longest
	// reconnect backoff of their start: each starts the next reconnect's
	// backoff one step further, so a connection the broker closes at once
	// every time (a message it cannot deliver, say) is not redialled, and
	// its prefetch window redelivered, ten times a second for ever.
	flaps := 0
	for {
		born := time.Now()
		var cause error
	watch:
		for {
			select {
			case e := <-g.connClosed:
				cause = closeCause("connection closed", e)
				break watch
			case e := <-g.chClosed:
				cause = closeCause("channel closed", e)
				break watch
			case tag := <-g.cancelled:
				cause = fmt.Errorf("the broker cancelled consumer %q (was the queue deleted?)", tag)
				break watch
			case <-g.pumped:
				cause = errors.New("the broker stopped delivering")
				break watch
			case <-health.C:
				s.warnOld(g)
			case <-s.closing:
				return
			}
		}
		// Close closes the channel and the connection after it closes
		// closing, and select picks at random among ready cases: a death
		// Close caused is no loss to report, nor a reason to reconnect.
		select {
		case <-s.closing:
			return
		default:
		}
		s.mu.Lock()
		hook := s.testHookChannelDied
		s.mu.Unlock()
		if hook != nil {
			hook()
		}
		s.kill(g, cause)
		if time.Since(born) < s.s.reconnectMax {
			flaps++
		} else {
			flaps = 0
		}
		if g = s.reconnect(flaps); g == nil {
			return
		}
	}
}

func closeCause(what string, e *amqp.Error) error {
	if e == nil {
		return errors.New(what)
	}
	return fmt.Errorf("%s: %w", what, e)
}

// kill ends generation g: its deliveries are lost (their handlers' contexts
// are cancelled with ErrConnectionLost), its pending acks dropped and
// counted, its connection closed.
func (s *Source) kill(g *generation, cause error) {
	held := g.die()
	s.mu.Lock()
	if s.gen == g {
		s.gen = nil
		if !s.closed {
			s.setConnLocked(adapters.Reconnecting, fmt.Errorf("rabbitmq: queue %q lost its channel: %w", s.queue, cause))
		}
	}
	s.mu.Unlock()
	if len(held) > 0 || cause != nil {
		s.s.logger.Warn("rabbitmq: lost the channel; reconnecting", "queue", s.queue, "address", s.s.address(), "generation", g.id, "cause", cause, "deliveries_lost", len(held))
	}
	s.lose(held, fmt.Errorf("%w (channel generation %d: %v)", adapters.ErrConnectionLost, g.id, cause))
	_ = g.conn.CloseDeadline(time.Now().Add(s.s.closeTimeout))
}

// lose cancels the contexts of held's handlers with cause, and counts them;
// the broker delivers their messages again.
func (s *Source) lose(held []*adapters.Delivery, cause error) {
	for _, d := range held {
		d.Signal.Lose(cause)
	}
	s.stats.lost.Add(uint64(len(held)))
	s.tel.add(s.tel.lost, len(held))
}

// reconnect dials until a new generation is consuming, backing off between
// attempts from a first wait that grows with flaps (see supervise), and
// logs the reconnection with how many attempts and how long it took. Failed
// attempts are not logged: Receive hands the runtime the first failure, and
// each of another kind (see errorKind). It returns nil when the Source
// closes first.
func (s *Source) reconnect(flaps int) *generation {
	bo := backoff.Exponential{Initial: s.s.reconnectMin, Max: s.s.reconnectMax, Multiplier: 2, Jitter: 0.2}
	down := time.Now()
	var last error
	for attempt := 1; ; attempt++ {
		wait := bo.Delay(flaps - 1 + attempt)
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-s.closing:
			t.Stop()
			return nil
		}
		ctx, cancel := context.WithTimeout(s.ctx, handshakeTimeout)
		g, err := s.connect(ctx)
		cancel()
		if err != nil {
			last = err
			s.mu.Lock()
			s.lastDialErr = fmt.Errorf("rabbitmq: reconnecting queue %q, with backoff: %w", s.queue, err)
			if addr := s.s.address(); !strings.Contains(err.Error(), addr) {
				s.lastDialErr = fmt.Errorf("rabbitmq: reconnecting queue %q to %s, with backoff: %w", s.queue, addr, err)
			}
			if kind := errorKind(err); kind != s.dialErrKind {
				s.dialErrKind, s.dialErrNew = kind, true
			}
			s.setConnLocked(adapters.Reconnecting, s.lastDialErr)
			s.mu.Unlock()
			continue
		}
		if !s.install(g) {
			return nil
		}
		s.tel.add(s.tel.reconnects, 1)
		s.s.logger.Info("rabbitmq: reconnected", "queue", s.queue, "address", s.s.address(), "generation", g.id,
			"attempts", attempt, "waited", wait, "down", time.Since(down).Round(time.Millisecond), "last_error", last)
		return g
	}
}

// errorKind names what kind of failure err is, without what changes from
// one attempt to the next (a local port, say), so that a reconnection
// failing the same way again is not reported again.
func errorKind(err error) string {
	var ae *amqp.Error
	var oe *net.OpError
	switch {
	case errors.As(err, &ae):
		return "amqp " + strconv.Itoa(ae.Code)
	case errors.As(err, &oe):
		if oe.Err != nil {
			return "net " + oe.Op + ": " + oe.Err.Error()
		}
		return "net " + oe.Op
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	default:
		return err.Error()
	}
}

// warnOld warns about deliveries held for more than half the consumer
// timeout: the broker will close the channel, and every delivery on it will
// come back, when one of them reaches the timeout.
func (s *Source) warnOld(g *generation) {
	var oldest time.Time
	n := 0
	g.mu.Lock()
	for _, d := range g.held {
		if time.Since(d.ReceivedAt) > s.s.consumerTimeout/2 {
			n++
			if oldest.IsZero() || d.ReceivedAt.Before(oldest) {
				oldest = d.ReceivedAt
			}
		}
	}
	g.mu.Unlock()
	if n > 0 {
		s.s.logger.Warn("rabbitmq: deliveries held unacked for more than half the consumer timeout; the broker closes the channel when one reaches it",
			"queue", s.queue, "deliveries", n, "oldest_age", time.Since(oldest).Round(time.Second), "consumer_timeout", s.s.consumerTimeout)
	}
}
