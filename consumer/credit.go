package consumer

import (
	"context"
	"sync"
)

// credit bounds the deliveries the runtime holds. The receiver asks for room
// only once a whole batch fits (or half the bound, when the bound is small):
// waking it for every freed slot would fetch one message per call.
//
// held counts the deliveries in the in-flight window (WithMaxInFlight).
// Where the source declares its queued deliveries free
// (Capabilities.FreeWhileQueued), those waiting behind their lane's running
// one are counted apart, in queued, and every delivery held, counted in
// either, is bounded by total (the source's MaxUnacked); total is zero
// otherwise. A queued delivery that moves on into the window counts in it
// again at once, even beyond the limit: the receiver then waits for the
// window to fall back below its low water.
type credit struct {
	mu       sync.Mutex
	held     int
	queued   int
	limit    int
	total    int // 0: no bound apart from limit
	batch    int
	lowWater int // the receiver wakes when held falls to this
	// totalLowWater is the same for held and queued together, when total
	// is set.
	totalLowWater int
	room          chan struct{}
}

func newCredit(limit, total, batch int) *credit {
	c := &credit{limit: limit, total: total, batch: batch, lowWater: lowWater(limit, batch), room: make(chan struct{}, 1)}
	if total > 0 {
		c.totalLowWater = lowWater(total, batch)
	}
	return c
}

// lowWater is where the receiver wakes for a bound of limit: room for a
// batch, or half the bound when the bound is small.
func lowWater(limit, batch int) int {
	low := max(limit-batch, limit/2)
	if low >= limit {
		low = limit - 1
	}
	return low
}

// roomLocked reports whether the receiver may take room; called with mu
// held.
func (c *credit) roomLocked() bool {
	return c.held <= c.lowWater && (c.total == 0 || c.held+c.queued <= c.totalLowWater)
}

// acquire waits for room and takes up to one batch of it. It reports false
// when ctx ends first.
func (c *credit) acquire(ctx context.Context) (int, bool) {
	for {
		c.mu.Lock()
		if c.roomLocked() {
			n := min(c.limit-c.held, c.batch)
			if c.total > 0 {
				n = min(n, c.total-c.held-c.queued)
			}
			c.held += n
			more := c.roomLocked()
			c.mu.Unlock()
			if more {
				// Room for another receiver too: pass the wake-up on, since
				// a release wakes only one.
				c.wake()
			}
			return n, true
		}
		c.mu.Unlock()
		select {
		case <-c.room:
		case <-ctx.Done():
			return 0, false
		}
	}
}

// release returns n units of the window (negative n takes more: an
// adapter returned more deliveries than asked).
func (c *credit) release(n int) { c.adjust(-n, 0) }

// releaseQueued returns n units of the deliveries queued behind their lanes.
func (c *credit) releaseQueued(n int) { c.adjust(0, -n) }

// queue moves n units out of the window: deliveries now queued behind their
// lane's running one. Negative n moves them back in.
func (c *credit) queue(n int) { c.adjust(-n, n) }

// adjust changes the window's and the queued counts and wakes a receiver
// if that made room (a wake-up without room only makes it look again).
func (c *credit) adjust(held, queued int) {
	if held == 0 && queued == 0 {
		return
	}
	c.mu.Lock()
	c.held += held
	c.queued += queued
	wake := c.roomLocked()
	c.mu.Unlock()
	if wake {
		c.wake()
	}
}

// wake lets one waiting receiver look for room.
func (c *credit) wake() {
	select {
	case c.room <- struct{}{}:
	default:
	}
}
