package rabbitmq

import (
	"errors"
	"fmt"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/prefix"
)

// A generation is one connection and one consuming channel. Delivery tags
// count from 1 on every channel, so a tag means something only together with
// its generation: every delivery carries the generation it came from, and
// an ack for a generation that has died is dropped rather than sent on the
// channel that replaced it, where the same tag names a different message.
type generation struct {
	src  *Source
	id   uint64
	conn *amqp.Connection
	ch   *amqp.Channel

	connClosed chan *amqp.Error
	chClosed   chan *amqp.Error
	cancelled  chan string
	msgs       <-chan amqp.Delivery
	pumped     chan struct{} // closed when msgs is drained and closed
	stopped    chan struct{} // closed when the generation dies

	mu   sync.Mutex
	dead bool
	// tracker holds every delivered tag until the run of finished tags from
	// the oldest passes it; a tag is done once it is acked or rejected on
	// the wire.
	tracker *prefix.Tracker
	// held maps every tag not yet settled on the wire to its delivery.
	held map[uint64]*adapters.Delivery
	// sentFrontier is the highest tag up to which everything is settled on
	// the wire.
	sentFrontier uint64
}

// state of one delivery in its generation.
type state uint8

const (
	stateHeld    state = iota // with the runtime
	stateAcking               // done in the tracker; its ack frame is being written
	stateSettled              // acked or rejected on the wire
	stateDropped              // its ack could not be written; the broker redelivers it
)

// handle is the adapter-private part of a Delivery (Delivery.Handle).
type handle struct {
	gen *generation
	tag uint64
	// signal loses the delivery when its channel dies.
	signal adapters.Signal
	state  state // guarded by gen.mu
	// gaveBack is set, under gen.mu, once a Nack or reject took the
	// delivery: its message comes back (requeued, or republished as a
	// copy), so an Ack of it must fail rather than report it settled.
	gaveBack bool
	// disposed is set, under gen.mu, once NativeDeadLetter rejected the
	// delivery: an Ack or Nack of it then succeeds without effect, since a
	// wrapper around the destination may hide that it settles the original.
	disposed bool
}

// errGaveBack fails an Ack of a delivery already given back.
var errGaveBack = errors.New("rabbitmq: the delivery was already given back (nacked); the broker delivers its message again")

func handleOf(d *adapters.Delivery) *handle {
	h, _ := d.Handle.(*handle)
	return h
}

// errTagOrder means the broker's delivery tags did not grow; the channel is
// abandoned, since a multiple ack could otherwise cover the wrong deliveries.
var errTagOrder = errors.New("rabbitmq: delivery tags arrived out of order")

// admit records a new delivery. It returns false when the generation died
// meanwhile (the broker redelivers the message), and errTagOrder when the
// tag is not above every earlier one.
func (g *generation) admit(d *adapters.Delivery, tag uint64) (bool, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.dead {
		return false, nil
	}
	if !g.tracker.Track(int64(tag)) {
		return false, errTagOrder
	}
	h := &handle{gen: g, tag: tag}
	d.Handle, d.Signal = h, &h.signal
	g.held[tag] = d
	return true, nil
}

// lostErr is the cause given to deliveries of a dead generation.
func (g *generation) lostErr() error {
	return fmt.Errorf("%w (channel generation %d closed)", adapters.ErrConnectionLost, g.id)
}

// ackLocked acks on the wire, before it returns, the deliveries of ds that
// belong to g (see the package documentation, section Acks go out at once):
// one multiple=true ack for the run of finished tags the frontier passed,
// named by the run's highest tag still outstanding, and one ack each for
// those of ds beyond the frontier. No tag is settled twice. Entries that
// cannot be acked are reported in failed. Deliveries already given back
// fail, unless replaced says they were given back as the copies confirmed
// meanwhile, whose originals this ack retires.
func (g *generation) ackLocked(ds []*adapters.Delivery, failed *entryErrors, replaced bool) {
	reachable := !g.unreachableLocked()
	marked := false
	for i, d := range ds {
		h := handleOf(d)
		if h == nil || h.gen != g {
			continue
		}
		switch {
		case h.disposed:
			// Settled by its dead-letter destination: nothing to send.
		case !reachable:
			// Dead, or amqp091 saw the channel or connection close and the
			// supervisor is about to mark the generation dead: the broker
			// redelivers the message.
			g.src.stats.droppedAcks.Add(1)
			g.src.tel.add(g.src.tel.dropped, 1)
			failed.set(i, g.lostErr())
		case h.gaveBack && !replaced:
			failed.set(i, errGaveBack)
		case h.state == stateDropped:
			failed.set(i, g.lostErr())
		case h.state == stateAcking || h.state == stateSettled:
			// Acked already, or earlier in ds: nothing more to send.
		default:
			h.state = stateAcking
			g.tracker.Done(int64(h.tag))
			marked = true
		}
	}
	if !marked {
		return
	}
	f, _ := g.tracker.Frontier()
	front := uint64(f)
	var runErr error
	if front > g.sentFrontier {
		var last uint64
		n := 0
		for tag := g.sentFrontier + 1; tag <= front; tag++ {
			if _, ok := g.held[tag]; ok {
				delete(g.held, tag)
				last, n = tag, n+1
			}
		}
		g.sentFrontier = front
		if n > 0 {
			runErr = g.writeAck(last, n)
		}
	}
	for i, d := range ds {
		h := handleOf(d)
		if h == nil || h.gen != g || h.state != stateAcking {
			continue
		}
		err := runErr
		if h.tag > front {
			delete(g.held, h.tag)
			err = g.writeAck(h.tag, 1)
		}
		if err != nil {
			h.state = stateDropped
			failed.set(i, fmt.Errorf("%w: %v", g.lostErr(), err))
			continue
		}
		h.state = stateSettled
	}
}

// writeAck writes one basic.ack naming tag, covering n outstanding tags
// (multiple=true when n > 1), and counts it.
func (g *generation) writeAck(tag uint64, n int) error {
	s := g.src
	err := g.ch.Ack(tag, n > 1)
	if err != nil {
		// The channel is closing: the broker redelivers the messages.
		s.stats.ackErrors.Add(uint64(n))
		s.tel.add(s.tel.dropped, n)
		return err
	}
	s.stats.ackFrames.Add(1)
	if n > 1 {
		s.stats.multipleAcks.Add(1)
	}
	s.stats.acked.Add(uint64(n))
	s.tel.ackFrame(n)
	return nil
}

// entryErrors collects the failed entries of a batch call, made on the first.
type entryErrors map[int]error

func (e *entryErrors) set(i int, err error) {
	if *e == nil {
		*e = map[int]error{}
	}
	(*e)[i] = err
}

// err returns the errors as the result of a batch call.
func (e entryErrors) err() error {
	if e == nil {
		return nil
	}
	return &adapters.BatchError{Failed: e}
}

// rejectLocked sends basic.nack for h at once, one tag only: a
// multiple=true nack would also reject deliveries still running.
func (g *generation) rejectLocked(h *handle, requeue bool) error {
	if h.disposed {
		return nil // settled by its dead-letter destination: nothing to send
	}
	if g.dead {
		return g.lostErr()
	}
	if h.state != stateHeld {
		return errors.New("rabbitmq: the delivery was already settled")
	}
	if err := g.ch.Nack(h.tag, false, requeue); err != nil {
		// The channel is closing: the delivery stays held, to be lost with
		// its generation, and the broker redelivers it.
		return fmt.Errorf("%w: %v", adapters.ErrConnectionLost, err)
	}
	h.state = stateSettled
	h.gaveBack = true
	delete(g.held, h.tag)
	g.src.stats.rejects.Add(1)
	g.src.tel.rejected(requeue)
	if g.tracker.Done(int64(h.tag)) {
		// Every finished tag the frontier passed is settled on the wire
		// already: finished tags are acked when they finish.
		f, _ := g.tracker.Frontier()
		g.sentFrontier = uint64(f)
	}
	return nil
}

// die marks the generation dead and returns the deliveries it still held;
// the caller loses them outside the lock.
func (g *generation) die() []*adapters.Delivery {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.dead {
		return nil
	}
	g.dead = true
	close(g.stopped)
	held := make([]*adapters.Delivery, 0, len(g.held))
	for _, d := range g.held {
		held = append(held, d)
	}
	g.held = nil
	return held
}

// unreachable reports whether the generation died, or amqp091 already saw
// its channel or connection close (the supervisor is about to mark it dead):
// either way its deliveries can no longer be settled, and the broker
// redelivers them.
func (g *generation) unreachable() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.unreachableLocked()
}

func (g *generation) unreachableLocked() bool {
	return g.dead || g.ch.IsClosed() || g.conn.IsClosed()
}

// pump moves deliveries from amqp091 to the Source's buffer, in tag order,
// until the channel closes. It drains amqp091's channel to the end even after
// the generation died, so the library never blocks on it.
func (g *generation) pump() {
	defer g.src.wg.Done()
	defer close(g.pumped)
	s := g.src
	for m := range g.msgs {
		d := s.delivery(m)
		ok, err := g.admit(d, m.DeliveryTag)
		if err != nil {
			s.s.logger.Error("rabbitmq: closing the channel", "queue", s.queue, "error", err, "tag", m.DeliveryTag)
			_ = g.ch.Close() // the supervisor sees the close and reconnects
		}
		if !ok {
			continue
		}
		s.stats.delivered.Add(1)
		select {
		case s.out <- d:
		case <-g.stopped:
		}
	}
}
