package awssqs

import (
	"context"
	"sync"
	"time"

	"github.com/custody-go/custody/adapters"
)

// visibilityBatcher gathers nacks into ChangeMessageVisibilityBatch requests.
// The runtime nacks one message at a time from its workers (each failure has
// its own backoff), and every entry of a batch carries its own timeout, so
// nacks from many workers can share a request: a nack waits up to the linger
// for nine others, and a full batch goes out at once.
type visibilityBatcher struct {
	s      *Source
	linger time.Duration

	mu      sync.Mutex
	pending []*nackEntry
	timer   *time.Timer
	closed  bool
	flushes sync.WaitGroup
}

type nackEntry struct {
	d     *adapters.Delivery
	delay time.Duration
	done  chan error // buffered: the flush never blocks on a caller gone away
}

func newVisibilityBatcher(s *Source, linger time.Duration) *visibilityBatcher {
	return &visibilityBatcher{s: s, linger: linger}
}

// submit queues ns for redelivery after their delays and waits for their
// batches. When ctx ends first it returns ctx's error; the entries are
// still sent.
func (b *visibilityBatcher) submit(ctx context.Context, ns []adapters.Nack) error {
	entries := make([]*nackEntry, len(ns))
	for i, n := range ns {
		entries[i] = &nackEntry{d: n.Delivery, delay: max(n.After, 0), done: make(chan error, 1)}
	}
	b.mu.Lock()
	b.pending = append(b.pending, entries...)
	switch {
	case b.closed || b.linger <= 0:
		b.flushLocked(len(b.pending))
	default:
		if full := len(b.pending) / maxBatch * maxBatch; full > 0 {
			b.flushLocked(full)
		}
		if len(b.pending) > 0 && b.timer == nil {
			b.timer = time.AfterFunc(b.linger, b.flushAll)
		}
	}
	b.mu.Unlock()

	failed := map[int]error{}
	for i, e := range entries {
		select {
		case err := <-e.done:
			if err != nil {
				failed[i] = err
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if len(failed) > 0 {
		return &adapters.BatchError{Failed: failed}
	}
	return nil
}

func (b *visibilityBatcher) flushAll() {
	b.mu.Lock()
	b.timer = nil
	b.flushLocked(len(b.pending))
	b.mu.Unlock()
}

// flushLocked sends the first n pending entries, ten per request, each
// request on its own goroutine tracked by b.flushes.
func (b *visibilityBatcher) flushLocked(n int) {
	for n > 0 {
		k := min(n, maxBatch)
		batch := b.pending[:k:k]
		b.pending = b.pending[k:]
		n -= k
		b.flushes.Add(1)
		go b.send(batch)
	}
	if len(b.pending) == 0 {
		b.pending = nil
		if b.timer != nil {
			b.timer.Stop()
			b.timer = nil
		}
	}
}

func (b *visibilityBatcher) send(batch []*nackEntry) {
	defer b.flushes.Done()
	now := time.Now()
	ds := make([]*adapters.Delivery, len(batch))
	secs := make([]int32, len(batch))
	for i, e := range batch {
		ds[i] = e.d
		secs[i] = nackTimeout(e.d, e.delay, now)
	}
	// The callers' contexts may be gone; a nack that is not sent only means
	// the message comes back later, when its current timeout runs out, so a
	// bounded context of its own is right.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := b.s.changeVisibility(ctx, ds, secs, nil)
	for i, e := range batch {
		e.done <- adapters.EntryError(err, i)
	}
}

// close sends what is pending and waits for every request in flight.
func (b *visibilityBatcher) close() {
	b.mu.Lock()
	b.closed = true
	b.flushLocked(len(b.pending))
	b.mu.Unlock()
	b.flushes.Wait()
}
