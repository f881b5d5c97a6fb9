package consumer

import (
	"context"
	"sync"
)

// credit bounds the deliveries the runtime holds. The receiver asks for room
// only once a whole batch fits (or half the bound, when the bound is small):
// waking it for every freed slot would fetch one message per call.
type credit struct {
	mu       sync.Mutex
	held     int
	limit    int
	batch    int
	lowWater int // the receiver wakes when held falls to this
	room     chan struct{}
}

func newCredit(limit, batch int) *credit {
	low := max(limit-batch, limit/2)
	if low >= limit {
		low = limit - 1
	}
	return &credit{limit: limit, batch: batch, lowWater: low, room: make(chan struct{}, 1)}
}

// acquire waits for room and takes up to one batch of it. It reports false
// when ctx ends first.
func (c *credit) acquire(ctx context.Context) (int, bool) {
	for {
		c.mu.Lock()
		if c.held <= c.lowWater {
			n := min(c.limit-c.held, c.batch)
			c.held += n
			more := c.held <= c.lowWater
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

// release returns n units (negative n takes more: an adapter returned more
// deliveries than asked).
func (c *credit) release(n int) {
	if n == 0 {
		return
	}
	c.mu.Lock()
	c.held -= n
	wake := c.held <= c.lowWater
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
