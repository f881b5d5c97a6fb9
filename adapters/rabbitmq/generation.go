package rabbitmq

import (
	"errors"
	"fmt"
	"sync"
	"time"

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
	// tracker holds every delivered tag until the durable prefix passes it;
	// a tag is done once its outcome is decided (ack pending, nacked,
	// republished and ack pending).
	tracker *prefix.Tracker
	// held maps every tag not yet settled on the wire to its delivery.
	held map[uint64]*adapters.Delivery
	// sentFrontier is the highest tag up to which everything is settled on
	// the wire.
	sentFrontier uint64
	pending      int // acks decided but not yet sent
	waiting      int // deliveries held in place for a delayed retry
	timer        *time.Timer
	timerArmed   bool
	timerAt      time.Time // when the armed timer fires
}

// state of one delivery in its generation.
type state uint8

const (
	stateHeld       state = iota // with the runtime
	stateWaiting                 // held by the adapter for an in-place retry
	stateAckPending              // finished; its ack is waiting to be coalesced
	stateSettled                 // acked or rejected on the wire
)

// handle is the adapter-private part of a Delivery (Delivery.Handle).
type handle struct {
	gen *generation
	tag uint64
	// signal loses the delivery when its channel dies.
	signal adapters.Signal
	state  state // guarded by gen.mu
	// decided is when the delivery's ack was decided (stateAckPending),
	// from which its wait for company is counted.
	decided time.Time
	// gaveBack is set, under gen.mu, once a Nack or reject took the
	// delivery: its message comes back (requeued, or republished as a
	// copy), so an Ack of it must fail rather than report it settled.
	gaveBack bool
}

// errGaveBack fails an Ack of a delivery already given back.
var errGaveBack = errors.New("rabbitmq: the delivery was already given back (nacked); the broker delivers its message again")

func handleOf(d *adapters.Delivery) *handle {
	h, _ := d.Handle.(*handle)
	return h
}

// errTagOrder means the broker's delivery tags did not grow; the channel is
// abandoned, since coalesced acks could otherwise cover the wrong deliveries.
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

// ackLocked marks h finished and coalesces its ack.
func (g *generation) ackLocked(h *handle) error {
	if g.dead {
		g.src.stats.droppedAcks.Add(1)
		return g.lostErr()
	}
	switch h.state {
	case stateAckPending, stateSettled:
		return nil // already decided; a second ack must not reach the wire
	}
	if g.ch.IsClosed() || g.conn.IsClosed() {
		// amqp091 saw the channel or the connection close and the
		// supervisor is about to mark the generation dead: an ack recorded
		// now would never be sent, and the broker redelivers the message.
		// Report the loss rather than a settled delivery; the generation's
		// death loses the delivery as it does every other one it holds.
		g.src.stats.droppedAcks.Add(1)
		return g.lostErr()
	}
	if h.state == stateWaiting {
		g.waiting--
	}
	h.state = stateAckPending
	h.decided = time.Now()
	g.pending++
	g.tracker.Done(int64(h.tag))
	f, _ := g.tracker.Frontier()
	if uint64(f)-g.sentFrontier >= uint64(g.src.s.ackBatch) || g.pending >= g.src.pressure() {
		g.flushLocked(false)
	}
	if g.pending > 0 {
		// In the run at the frontier, the ack waits for company for the
		// linger; behind an unfinished delivery, for the straggler wait,
		// then it goes out on its own.
		wait := g.src.s.ackLinger
		if int64(h.tag) > f {
			wait = g.src.s.stragglerWait
		}
		g.armLocked(h.decided.Add(wait))
	}
	return nil
}

// rejectLocked sends basic.nack for h at once: rejects are never coalesced,
// since a multiple=true nack would also reject deliveries still running.
func (g *generation) rejectLocked(h *handle, requeue bool) error {
	if g.dead {
		return g.lostErr()
	}
	if h.state == stateAckPending || h.state == stateSettled {
		return errors.New("rabbitmq: the delivery was already settled")
	}
	if err := g.ch.Nack(h.tag, false, requeue); err != nil {
		// The channel is closing: the delivery stays held, to be lost with
		// its generation, and the broker redelivers it.
		return fmt.Errorf("%w: %v", adapters.ErrConnectionLost, err)
	}
	if h.state == stateWaiting {
		g.waiting--
	}
	h.state = stateSettled
	h.gaveBack = true
	delete(g.held, h.tag)
	g.src.stats.rejects.Add(1)
	if g.tracker.Done(int64(h.tag)) {
		f, _ := g.tracker.Frontier()
		if uint64(f)-g.sentFrontier >= uint64(g.src.s.ackBatch) {
			g.flushLocked(false)
		}
		if g.pending > 0 {
			// The frontier moved: acks that waited behind this delivery
			// are a run now, due after the linger.
			g.armLocked(time.Now().Add(g.src.s.ackLinger))
		}
	}
	return nil
}

// flushLocked sends what the coalescing policy allows: one multiple=true ack
// for the finished run up to the frontier, then one ack each for the
// finished deliveries behind an unfinished one that waited the straggler
// wait since their ack was decided (all of them when they fill most of the
// window, or with force). A delivery acked on its own is settled on the
// wire: the next multiple ack names a tag still outstanding.
func (g *generation) flushLocked(force bool) {
	if g.dead {
		return
	}
	s := g.src
	if f, ok := g.tracker.Frontier(); ok && uint64(f) > g.sentFrontier {
		// Name the highest tag in the run that is still outstanding on the
		// wire: the broker rejects a multiple ack naming a tag it no longer
		// holds (one rejected or acked on its own) and closes the channel.
		var last uint64
		n := 0
		for tag := g.sentFrontier + 1; tag <= uint64(f); tag++ {
			d, ok := g.held[tag]
			if !ok {
				continue // settled on its own earlier
			}
			h := handleOf(d)
			h.state = stateSettled
			delete(g.held, tag)
			last = tag
			n++
		}
		g.sentFrontier = uint64(f)
		if last > 0 {
			g.pending -= n
			if err := g.ch.Ack(last, true); err != nil {
				s.stats.ackErrors.Add(uint64(n))
			}
			s.stats.ackFrames.Add(1)
			s.stats.multipleAcks.Add(1)
			s.stats.acked.Add(uint64(n))
		}
	}
	if g.pending == 0 {
		return
	}
	all := force || g.pending >= s.pressure()
	now := time.Now()
	g.tracker.DoneBeyond(func(pos int64) {
		tag := uint64(pos)
		d, ok := g.held[tag]
		if !ok {
			return
		}
		h := handleOf(d)
		if h.state != stateAckPending || !all && now.Sub(h.decided) < s.s.stragglerWait {
			return
		}
		h.state = stateSettled
		delete(g.held, tag)
		g.pending--
		if err := g.ch.Ack(tag, false); err != nil {
			s.stats.ackErrors.Add(1)
		}
		s.stats.ackFrames.Add(1)
		s.stats.acked.Add(1)
	})
}

// armLocked makes sure the timer fires by at, when a pending ack is due.
func (g *generation) armLocked(at time.Time) {
	if g.dead || g.pending == 0 {
		return
	}
	if g.timerArmed && !at.Before(g.timerAt) {
		return
	}
	// Not armed, or armed for later than this ack may wait. (Should the
	// timer have fired already and its callback wait for the lock, it runs
	// twice: harmless.)
	g.timerArmed, g.timerAt = true, at
	wait := time.Until(at)
	if g.timer == nil {
		g.timer = time.AfterFunc(wait, g.onTimer)
	} else {
		g.timer.Reset(wait)
	}
}

// onTimer sends what is due and arms the timer for the acks still waiting
// behind an unfinished delivery: for the earliest of their straggler waits.
func (g *generation) onTimer() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.timerArmed = false
	if g.dead {
		return
	}
	g.flushLocked(false)
	if g.pending == 0 {
		return
	}
	var next time.Time
	g.tracker.DoneBeyond(func(pos int64) {
		if d, ok := g.held[uint64(pos)]; ok {
			if h := handleOf(d); h.state == stateAckPending && (next.IsZero() || h.decided.Before(next)) {
				next = h.decided
			}
		}
	})
	if !next.IsZero() {
		g.armLocked(next.Add(g.src.s.stragglerWait))
	}
}

// die marks the generation dead and returns the deliveries it still held;
// the caller loses them outside the lock. Pending acks are dropped and
// counted: their messages come back from the broker.
func (g *generation) die(flush bool) []*adapters.Delivery {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.dead {
		return nil
	}
	if flush {
		g.flushLocked(true)
	}
	g.dead = true
	close(g.stopped)
	if g.timer != nil {
		g.timer.Stop()
	}
	held := make([]*adapters.Delivery, 0, len(g.held))
	for _, d := range g.held {
		if handleOf(d).state == stateAckPending {
			g.src.stats.droppedAcks.Add(1)
		}
		held = append(held, d)
	}
	g.held = nil
	g.pending = 0
	return held
}

// unreachable reports whether the generation died, or amqp091 already saw
// its channel or connection close (the supervisor is about to mark it dead):
// either way its deliveries can no longer be settled, and the broker
// redelivers them.
func (g *generation) unreachable() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
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
