package memory

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/option"
)

// Source consumes one queue of a Broker. It implements adapters.Source and
// adapters.Extender. Deliveries' Native value is a memory.Message.
type Source struct {
	b        *Broker
	q        *queue
	pollWait time.Duration
	closed   atomic.Bool
	crashed  atomic.Bool
	stopOnce sync.Once
	stopped  chan struct{} // closed by Close or Crash, to end a waiting Receive

	faultsMu sync.Mutex
	faults   Faults
}

// Faults injects failures, for tests of what a consumer does when the broker
// misbehaves. Each hook, when set, is asked about every delivery in a call;
// a non-nil error fails that entry as the broker would. Hooks run outside the
// broker's lock, so they may use the Broker (Stats, Publish).
type Faults struct {
	Ack    func(d *adapters.Delivery) error
	Nack   func(d *adapters.Delivery) error
	Extend func(d *adapters.Delivery) error
	// Receive, when set, is called before each Receive of a source that is
	// neither closed nor crashed (those fail with adapters.ErrClosed first);
	// a non-nil error is returned instead of messages.
	Receive func() error
}

// SourceOption configures a Source.
type SourceOption func(*Source) error

// WithPollWait sets how long Receive waits for a message before returning
// none, as an SQS long poll does. Default 1s.
func WithPollWait(d time.Duration) SourceOption {
	return func(s *Source) error {
		if d <= 0 {
			return fmt.Errorf("memory: WithPollWait(%v): must be positive", d)
		}
		s.pollWait = d
		return nil
	}
}

// WithFaults installs fault hooks from the start; SetFaults changes them
// later.
func WithFaults(f Faults) SourceOption {
	return func(s *Source) error { s.faults = f; return nil }
}

// Source returns a consumer of the named queue. Each Source is one consumer
// process as far as the broker is concerned.
func (b *Broker) Source(queueName string, opts ...SourceOption) (*Source, error) {
	q, ok := b.lookup(queueName)
	if !ok {
		return nil, fmt.Errorf("memory: Source(%q): %w", queueName, ErrNoQueue)
	}
	s := &Source{b: b, q: q, pollWait: time.Second, stopped: make(chan struct{})}
	if err := option.Apply(s, opts); err != nil {
		return nil, err
	}
	return s, nil
}

// SetFaults replaces the fault hooks.
func (s *Source) SetFaults(f Faults) {
	s.faultsMu.Lock()
	s.faults = f
	s.faultsMu.Unlock()
}

func (s *Source) getFaults() Faults {
	s.faultsMu.Lock()
	defer s.faultsMu.Unlock()
	return s.faults
}

// Crash makes the source behave like a consumer process that died: every
// later call, and a Receive waiting at the time, fails with
// adapters.ErrClosed, nothing it holds is acked, and the broker redelivers
// its messages when their leases run out.
func (s *Source) Crash() {
	s.crashed.Store(true)
	s.stop()
}

func (s *Source) dead() bool { return s.closed.Load() || s.crashed.Load() }

// stop ends a Receive waiting on the source: a poll may wait far longer than
// whoever closes the source should have to wait for it.
func (s *Source) stop() { s.stopOnce.Do(func() { close(s.stopped) }) }

// Capabilities implements adapters.Source.
func (s *Source) Capabilities() adapters.Capabilities {
	return adapters.Capabilities{
		Name:             "memory:" + s.q.name,
		Lease:            s.q.opts.Lease,
		NackDelay:        true,
		CountsDeliveries: true,
		Ordered:          s.q.opts.FIFO,
	}
}

// Receive implements adapters.Source.
func (s *Source) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	if max <= 0 {
		return nil, fmt.Errorf("memory: Receive: max %d must be positive", max)
	}
	if s.dead() {
		return nil, adapters.ErrClosed // before the fault hook: a closed source says so
	}
	if f := s.getFaults().Receive; f != nil {
		if err := f(); err != nil {
			return nil, err
		}
	}
	deadline := time.Now().Add(s.pollWait)
	for {
		if s.dead() {
			return nil, adapters.ErrClosed
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		now := time.Now()
		s.b.mu.Lock()
		out, lost, next := s.b.receive(s.q, s, max, now, nil)
		var wake chan struct{}
		if len(out) == 0 {
			wake = s.q.waitChan()
		}
		s.b.mu.Unlock()
		for _, d := range lost {
			d.Signal.Lose(errStaleReceipt)
		}
		if len(out) > 0 {
			return out, nil
		}
		if !now.Before(deadline) {
			return nil, nil
		}
		wait := deadline.Sub(now)
		if !next.IsZero() && next.Sub(now) < wait {
			wait = next.Sub(now)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-s.stopped:
			return nil, adapters.ErrClosed
		case <-wake:
		case <-time.After(wait):
		}
	}
}

// settle applies op to each delivery whose receipt is still valid, after the
// fault hook, and collects per-entry errors.
func (s *Source) settle(ds []*adapters.Delivery, fault func(*adapters.Delivery) error, op func(i int, q *queue, m *message, now time.Time) error) error {
	if s.dead() {
		return adapters.ErrClosed
	}
	var failed map[int]error
	fail := func(i int, err error) {
		if failed == nil {
			failed = make(map[int]error)
		}
		failed[i] = err
	}
	hs := make([]*handle, len(ds))
	for i, d := range ds {
		h, ok := d.Handle.(*handle)
		if !ok || h.src.q != s.q {
			fail(i, fmt.Errorf("memory: delivery %q did not come from queue %q", d.ID, s.q.name))
			continue
		}
		// Outside the broker's lock (see Faults).
		if fault != nil {
			if err := fault(d); err != nil {
				fail(i, err)
				continue
			}
		}
		hs[i] = h
	}
	now := time.Now()
	s.b.mu.Lock()
	for i, h := range hs {
		if h == nil {
			continue
		}
		if !h.valid() {
			fail(i, errStaleReceipt)
			continue
		}
		if err := op(i, s.q, h.m, now); err != nil {
			fail(i, err)
		}
	}
	s.b.mu.Unlock()
	if failed != nil {
		return &adapters.BatchError{Failed: failed}
	}
	return nil
}

// Ack implements adapters.Source: it deletes the messages.
func (s *Source) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	return s.settle(ds, s.getFaults().Ack, func(_ int, q *queue, m *message, now time.Time) error {
		q.remove(m)
		m.deleted = true
		m.holder = nil
		if q.opts.FIFO && !m.ready {
			q.release(m.key)
		}
		q.stats.Acked++
		q.noteIfEmpty()
		return nil
	})
}

// Nack implements adapters.Source: each message becomes visible again after
// its entry's delay.
func (s *Source) Nack(ctx context.Context, ns []adapters.Nack) error {
	ds := make([]*adapters.Delivery, len(ns))
	for i, n := range ns {
		ds[i] = n.Delivery
	}
	return s.settle(ds, s.getFaults().Nack, func(i int, q *queue, m *message, now time.Time) error {
		if err := q.setVisibleAt(m, now.Add(ns[i].After), now); err != nil {
			return err
		}
		m.holder = nil
		return nil
	})
}

// Extend implements adapters.Extender: the messages stay invisible for d from
// now. A message whose lease ran out can still be extended by its holder
// until someone receives it again, except on a FIFO queue once another
// Receive holds its group: that entry fails with adapters.ErrLeaseLost, as
// two receives may not hold one group (a Nack with a delay fails likewise).
func (s *Source) Extend(ctx context.Context, ds []*adapters.Delivery, d time.Duration) error {
	return s.settle(ds, s.getFaults().Extend, func(_ int, q *queue, m *message, now time.Time) error {
		if err := q.setVisibleAt(m, now.Add(d), now); err != nil {
			return err
		}
		q.stats.Extended++
		return nil
	})
}

// Close implements adapters.Source. Messages received and not acked stay
// leased until their visibility timeout, then are delivered again. A Receive
// waiting on the source returns adapters.ErrClosed.
func (s *Source) Close() error {
	s.closed.Store(true)
	s.stop()
	return nil
}

// Backlog implements adapters.BacklogReporter: the queue's visible
// messages, those received or delayed and not yet settled, and the age of
// the oldest visible one.
func (s *Source) Backlog(ctx context.Context) (adapters.Backlog, error) {
	if s.dead() {
		return adapters.Backlog{}, adapters.ErrClosed
	}
	now := time.Now()
	s.b.mu.Lock()
	defer s.b.mu.Unlock()
	s.q.promote(now)
	b := adapters.Backlog{Waiting: int64(len(s.q.ready)), InFlight: int64(len(s.q.waiting))}
	if len(s.q.ready) > 0 {
		b.OldestAge = now.Sub(s.q.ready[0].published)
	}
	return b, nil
}
