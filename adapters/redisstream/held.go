package redisstream

import (
	"sync/atomic"

	"github.com/custody-go/custody/adapters"
)

// held is what the Source keeps of an entry it handed out: the Delivery
// (whose Handle points back here), the Signal through which a loss the
// Source learns of outside a call reaches the runtime (the group vanished),
// and the Source that read it. Receive allocates them a batch at a time.
type held struct {
	d   adapters.Delivery
	sig adapters.Signal
	src *Source
	// count is the group's delivery count of the entry for this delivery
	// (1 when read, counted up by every claim that handed it out). The
	// renewal and give-back scripts act only while the entry's count is
	// still this one: the owner alone cannot tell this delivery from a
	// later one of the same entry to the same consumer (see Leases in the
	// package documentation).
	count int64
	// deadLettered is set once a DeadLetter acknowledged the entry in the
	// script that stored its copy: an Ack, Nack or renewal of it then
	// succeeds without a command.
	deadLettered atomic.Bool
}

// isDeadLettered reports whether a DeadLetter acknowledged d with its copy.
func isDeadLettered(d *adapters.Delivery) bool {
	h := heldOf(d)
	return h != nil && h.deadLettered.Load()
}

// heldOf returns the Source's state of d, or nil for a delivery no Source
// handed out.
func heldOf(d *adapters.Delivery) *held {
	h, _ := d.Handle.(*held)
	return h
}

// minSweep is the fewest held entries at which hold looks for entries the
// runtime lost by itself.
const minSweep = 1024

// hold records ds, handed to the runtime, as held until they are acked,
// given back or found lost.
func (s *Source) hold(ds []*adapters.Delivery) {
	if len(ds) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	if s.held == nil {
		s.held = make(map[*held]struct{})
	}
	for _, d := range ds {
		s.held[d.Handle.(*held)] = struct{}{}
	}
	if len(s.held) >= max(s.sweepAt, minSweep) {
		// The runtime gives up, without a call, deliveries whose leases it
		// could not renew; their Signal says so. Dropping them here, as
		// the set doubles, keeps it as large as what the runtime holds.
		for h := range s.held {
			if h.sig.LostCause() != nil {
				delete(s.held, h)
			}
		}
		s.sweepAt = 2 * len(s.held)
	}
}

// unhold drops ds from the held entries of their Sources: the runtime
// passed them to Ack or Nack, or a call found them lost.
func (s *Source) unhold(ds []*adapters.Delivery) {
	if len(ds) == 0 {
		return
	}
	s.mu.Lock()
	var others []*held
	for _, d := range ds {
		switch h := heldOf(d); {
		case h == nil:
		case h.src == s:
			delete(s.held, h)
		default:
			others = append(others, h)
		}
	}
	s.mu.Unlock()
	for _, h := range others {
		h.src.mu.Lock()
		delete(h.src.held, h)
		h.src.mu.Unlock()
	}
}

// takeHeldLocked returns the held entries and forgets them. Called with mu
// held.
func (s *Source) takeHeldLocked() []*held {
	hs := make([]*held, 0, len(s.held))
	for h := range s.held {
		hs = append(hs, h)
	}
	clear(s.held)
	s.sweepAt = 0
	return hs
}

// splitHeld splits ids into those this Source does not hold and those it
// does (handed to the runtime, not yet acked, given back or found lost).
// It looks through every held entry: it runs only for entries a reclaim
// found deleted from the stream, which is rare.
func (s *Source) splitHeld(ids []string) (others, held []string) {
	s.mu.Lock()
	byID := make(map[string]bool, len(s.held))
	for h := range s.held {
		byID[h.d.ID] = true
	}
	s.mu.Unlock()
	for _, id := range ids {
		if byID[id] {
			held = append(held, id)
		} else {
			others = append(others, id)
		}
	}
	return others, held
}
