package consumer

import (
	"sync"
	"time"

	"github.com/custody-go/custody/adapters"
)

// groupCommitWait bounds how long an entry of a batcher without a linger
// waits for company when no worker runs out of work to send it sooner.
const groupCommitWait = time.Millisecond

// batcher gathers the jobs of one operation (ack or nack) into calls shaped
// by the adapter's Batching: a batch goes out when it is full; when its
// oldest entry has waited the linger; and, once a call of the operation
// ends, with what gathered meanwhile if that is due. At most maxCalls calls
// are under way at once.
//
// Without a linger the calls are cheap and local (an in-process broker, an
// AMQP ack that has no reply): the goroutine that finds a batch due makes
// the call itself, so a quick ack costs no hand-off between goroutines, and
// workers send what is pending before they wait for work (flush). Every
// entry is then due at once, and a call ending sends what gathered during
// it: group commit. With a linger the calls are round trips billed per
// request (SQS): they run on goroutines the batcher owns, so that a handler
// never waits for one, and entries wait for company until the linger.
type batcher struct {
	max      int
	linger   time.Duration
	maxCalls int
	inline   bool
	// call makes one call for batch and settles its jobs. It owns the
	// slice until it returns.
	call func(batch []*job)

	mu      sync.Mutex
	pending []*job
	spare   []*job    // a drained slice, reused for pending
	oldest  time.Time // when the oldest pending entry was added (linger only)
	calls   int
	timer   *time.Timer
	armed   bool
	wg      sync.WaitGroup // calls on goroutines of their own, and an armed timer
}

// defaultMaxEntries bounds a batch for adapters that set no limit.
const defaultMaxEntries = 256

func newBatcher(b adapters.Batching, call func([]*job)) *batcher {
	bt := &batcher{
		max:      b.MaxEntries,
		linger:   b.Linger,
		maxCalls: max(b.MaxCalls, 1),
		inline:   b.Linger <= 0,
		call:     call,
	}
	if bt.max <= 0 {
		bt.max = defaultMaxEntries
	}
	bt.timer = time.AfterFunc(time.Hour, bt.expired)
	bt.timer.Stop()
	return bt
}

// add queues j. It sends a batch that is full, on this goroutine when the
// batcher has no linger.
func (b *batcher) add(j *job) { b.addAll([]*job{j}) }

// addAll queues js, as add does each.
func (b *batcher) addAll(js []*job) {
	if len(js) == 0 {
		return
	}
	b.mu.Lock()
	if len(b.pending) == 0 && !b.inline {
		b.oldest = time.Now()
	}
	b.pending = append(b.pending, js...)
	if len(b.pending) >= b.max && b.calls < b.maxCalls {
		b.sendLocked(false) // unlocks
		return
	}
	b.armLocked()
	b.mu.Unlock()
}

// flush sends what is pending now, if a call may start; workers call it
// before they wait for work. It does nothing for a batcher with a linger:
// its entries wait for company.
func (b *batcher) flush() {
	if !b.inline {
		return
	}
	b.mu.Lock()
	if len(b.pending) == 0 || b.calls >= b.maxCalls {
		b.mu.Unlock()
		return
	}
	b.sendLocked(true) // unlocks
}

// armLocked makes sure the timer will send what is pending.
func (b *batcher) armLocked() {
	if b.armed || len(b.pending) == 0 {
		return
	}
	wait := groupCommitWait
	if !b.inline {
		wait = time.Until(b.oldest.Add(b.linger))
	}
	b.armed = true
	b.wg.Add(1)
	b.timer.Reset(wait)
}

// expired runs on the timer's goroutine.
func (b *batcher) expired() {
	defer b.wg.Done()
	b.mu.Lock()
	b.armed = false
	if len(b.pending) == 0 || b.calls >= b.maxCalls {
		// A call under way sends what is due when it ends.
		b.mu.Unlock()
		return
	}
	b.sendLocked(true) // unlocks
}

// dueLocked reports whether the pending entries should go now rather than
// wait for company.
func (b *batcher) dueLocked() bool {
	return len(b.pending) >= b.max || b.inline || time.Since(b.oldest) >= b.linger
}

// sendLocked starts calls for what is pending while a call may start and
// the pending entries are full or due (or force, for the first call). Called
// with mu held; returns with it released.
func (b *batcher) sendLocked(force bool) {
	for len(b.pending) > 0 && b.calls < b.maxCalls && (force || b.dueLocked()) {
		force = false
		n := min(len(b.pending), b.max)
		batch := b.pending[:n:n]
		if n == len(b.pending) {
			b.pending = b.spare[:0]
			b.spare = nil
		} else {
			b.pending = b.pending[n:]
		}
		b.calls++
		if !b.inline {
			b.wg.Add(1)
			go func() {
				defer b.wg.Done()
				b.call(batch)
				b.ended(batch)
			}()
			continue
		}
		b.mu.Unlock()
		b.call(batch)
		b.mu.Lock()
		b.endedLocked(batch)
	}
	b.armLocked()
	b.mu.Unlock()
}

// ended records the end of a call made on a goroutine of its own and sends
// what became due meanwhile.
func (b *batcher) ended(batch []*job) {
	b.mu.Lock()
	b.endedLocked(batch)
	b.sendLocked(false) // unlocks
}

func (b *batcher) endedLocked(batch []*job) {
	b.calls--
	if b.spare == nil {
		clear(batch)
		b.spare = batch[:0]
	}
}

// close waits for the calls under way and the timer. Every job added was
// settled by then: the run calls it once nothing is held.
func (b *batcher) close() {
	b.mu.Lock()
	if b.armed && b.timer.Stop() {
		b.armed = false
		b.wg.Done()
	}
	b.mu.Unlock()
	b.wg.Wait()
}
