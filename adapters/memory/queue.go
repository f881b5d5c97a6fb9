package memory

import (
	"container/heap"
	"time"

	"github.com/custody-go/custody/adapters"
)

// message is one message in a queue.
type message struct {
	id        string
	body      []byte
	headers   map[string]string
	key       string
	seq       uint64
	published time.Time

	receives      int
	firstReceived time.Time
	visibleAt     time.Time
	receipt       uint64 // the receipt of the latest receive; 0 before any
	batch         uint64 // the Receive call of the latest receive
	holder        *adapters.Delivery
	deleted       bool
	ready         bool // in the ready heap (else in the waiting heap)
	index         int  // position in its heap
}

// queue is guarded by Broker.mu.
type queue struct {
	name string
	opts QueueOptions

	ready   readyHeap   // visible messages by publish order
	waiting waitingHeap // received or delayed messages by visibleAt
	busy    map[string]int
	// holding is, for each busy FIFO group, the Receive call (batch) its
	// messages in flight came from: one call at a time holds a group.
	holding map[string]uint64
	wake    chan struct{} // closed when something becomes visible or will sooner; nil when nobody waits
	emptied chan struct{} // closed when the queue becomes empty; nil when nobody waits (see Broker.WaitEmpty)

	stats Stats
}

func newQueue(name string, opts QueueOptions) *queue {
	return &queue{name: name, opts: opts, busy: make(map[string]int), holding: make(map[string]uint64)}
}

// signal wakes receivers waiting for a visible message.
func (q *queue) signal() {
	if q.wake != nil {
		close(q.wake)
		q.wake = nil
	}
}

func (q *queue) waitChan() chan struct{} {
	if q.wake == nil {
		q.wake = make(chan struct{})
	}
	return q.wake
}

// promote makes every message whose visibility time has come visible again,
// and returns when the next one will be.
func (q *queue) promote(now time.Time) (next time.Time) {
	for len(q.waiting) > 0 {
		m := q.waiting[0]
		if m.visibleAt.After(now) {
			return m.visibleAt
		}
		heap.Pop(&q.waiting)
		q.makeReady(m)
	}
	return time.Time{}
}

func (q *queue) makeReady(m *message) {
	if m.receipt != 0 && q.opts.FIFO {
		q.release(m.key)
	}
	m.ready = true
	heap.Push(&q.ready, m)
	q.signal()
}

func (q *queue) release(group string) {
	if n := q.busy[group] - 1; n > 0 {
		q.busy[group] = n
	} else {
		delete(q.busy, group)
		delete(q.holding, group)
		// Messages of the group that were held back are receivable now: a
		// receiver waiting for them must not sleep until its poll ends.
		q.signal()
	}
}

// empty reports whether the queue holds no message, visible, received or
// delayed.
func (q *queue) empty() bool { return len(q.ready) == 0 && len(q.waiting) == 0 }

// noteIfEmpty wakes those waiting for the queue to empty, if it has. Called
// wherever messages leave the queue: an ack, a redrive.
func (q *queue) noteIfEmpty() {
	if q.emptied != nil && q.empty() {
		close(q.emptied)
		q.emptied = nil
	}
}

// remove takes m out of whichever heap holds it.
func (q *queue) remove(m *message) {
	if m.ready {
		heap.Remove(&q.ready, m.index)
	} else {
		heap.Remove(&q.waiting, m.index)
	}
}

// messages returns the queue's messages, visible or not, in publish order.
func (q *queue) messages() []*message {
	all := make([]*message, 0, len(q.ready)+len(q.waiting))
	all = append(all, q.ready...)
	all = append(all, q.waiting...)
	sortBySeq(all)
	return all
}

// hold marks m's FIFO group as held by m's Receive call.
func (q *queue) hold(m *message) {
	q.busy[m.key]++
	q.holding[m.key] = m.batch
}

// setVisibleAt moves m (ready or waiting) to become visible at t. It fails
// for a FIFO message whose lease ran out if another Receive call holds its
// group now: keeping it would put two receives' messages of the group in
// flight at once.
func (q *queue) setVisibleAt(m *message, t time.Time, now time.Time) error {
	if !t.After(now) {
		if !m.ready {
			heap.Remove(&q.waiting, m.index)
			q.makeReady(m)
		}
		return nil
	}
	if m.ready && q.opts.FIFO && q.busy[m.key] > 0 && q.holding[m.key] != m.batch {
		return errStaleReceipt
	}
	earlier := t.Before(m.visibleAt)
	m.visibleAt = t
	if m.ready {
		// The lease had run out but nobody took the message yet: the holder
		// keeps it, as SQS lets a valid receipt handle extend visibility.
		heap.Remove(&q.ready, m.index)
		m.ready = false
		if q.opts.FIFO {
			q.hold(m)
		}
		heap.Push(&q.waiting, m)
		// Receivers waiting for its group computed their wait without it:
		// wake them to wait for t too.
		q.signal()
		return nil
	}
	heap.Fix(&q.waiting, m.index)
	if earlier {
		// Receivers wait until the time they last computed for the next
		// message to become visible (a nacked message's lease); wake them
		// to wait for the new, earlier one.
		q.signal()
	}
	return nil
}

type readyHeap []*message

func (h readyHeap) Len() int           { return len(h) }
func (h readyHeap) Less(i, j int) bool { return h[i].seq < h[j].seq }
func (h readyHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i]; h[i].index = i; h[j].index = j }
func (h *readyHeap) Push(x any)        { m := x.(*message); m.index = len(*h); *h = append(*h, m) }
func (h *readyHeap) Pop() any {
	old := *h
	m := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return m
}

type waitingHeap []*message

func (h waitingHeap) Len() int           { return len(h) }
func (h waitingHeap) Less(i, j int) bool { return h[i].visibleAt.Before(h[j].visibleAt) }
func (h waitingHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i]; h[i].index = i; h[j].index = j }
func (h *waitingHeap) Push(x any)        { m := x.(*message); m.index = len(*h); *h = append(*h, m) }
func (h *waitingHeap) Pop() any {
	old := *h
	m := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return m
}
