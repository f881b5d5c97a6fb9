package lease

import (
	"math"

	"github.com/custody-go/custody/adapters"
)

// Times inside the keeper are int64 nanoseconds since the keeper's epoch
// (ticks), read from the monotonic clock: cheaper to store and compare than
// time.Time values, which carry a wall and a monotonic reading each.

// never is the tick of something that does not happen: no hold cap, nothing
// scheduled.
const never = math.MaxInt64

// addTicks returns t+d for d >= 0, or never when that does not fit.
func addTicks(t, d int64) int64 {
	if t > never-d {
		return never
	}
	return t + d
}

// slot is the keeper's state for one tracked lease. The keeper owns its
// slots, apart from the caller's Lease values, which only name a slot and
// its generation: the keeper never touches a Lease after Stop returned, so
// its owner may reuse or drop it, and a stale reference to a slot (in the
// heap, or in a Lease stopped long ago) is told apart by the generation.
type slot struct {
	d        *adapters.Delivery
	expires  int64 // when the broker lets the lease run out, as last granted
	deadline int64 // the hold cap; never: no cap
	// renewing is open while the keeper works on the lease outside its
	// lock: a renewal taken or on the wire, or a loss being made. Stop
	// waits for it to close.
	renewing chan struct{}
	gen      uint64 // bumped when the slot is freed
	queued   bool   // the slot has a live entry in the heap
	stopped  bool
	// retry is set when the queued due time is a retry of a failed
	// renewal. A retry is taken when due, not early with the leases due
	// soon: its next retry would fall within the slack again and be taken
	// at once.
	retry bool
}

// entry is a slot's place in the schedule. It is stale, and skipped, once
// the slot's generation moved on: Stop frees a slot at once and leaves its
// entry behind rather than look for it in the heap.
//
// Only the low 32 bits of the generation are kept. A stale entry leaves the
// heap when it reaches the top (by its due time, a lease length away at
// most) or at the next compaction, long before its slot can be freed 2^32
// more times.
type entry struct {
	due  int64
	slot int32
	gen  uint32
}

// minStale is the number of stale entries below which a keeper's heap is
// not compacted, however few live ones it holds, so that a keeper tracking
// a handful of leases does not compact on every Stop.
const minStale = 64

// table holds the tracked leases: their slots, a free list of slots, and a
// binary min-heap of due times with lazy removal. Its methods assume the
// keeper's lock is held.
type table struct {
	slots []slot
	free  []int32 // freed slots, reused last freed first (warm in cache)
	heap  []entry
	stale int // entries in heap whose slot was freed since
	live  int // slots in use: queued, taken for renewal, or being lost
	// minStale is the keeper's minStale (tests use others).
	minStale int
}

// alloc returns a free slot, zero but for its generation.
func (t *table) alloc() int32 {
	t.live++
	if n := len(t.free); n > 0 {
		i := t.free[n-1]
		t.free = t.free[:n-1]
		return i
	}
	if len(t.slots) >= math.MaxInt32 {
		panic("lease: too many leases tracked")
	}
	t.slots = append(t.slots, slot{})
	return int32(len(t.slots) - 1)
}

// release frees slot i, leaving its heap entry (if any) stale, and compacts
// the heap once stale entries outnumber queued ones (and minStale). Stale
// entries never outnumber the slots in use by more than minStale (the
// scheduler taking leases off the heap leaves them as they are, but a slot
// it frees is checked here), so the heap stays within twice the tracked
// leases plus minStale; each compaction, linear in the heap, is paid for by
// the Stops that made it due.
func (t *table) release(i int32) {
	if t.slots[i].queued {
		t.stale++
	}
	t.freeSlot(i)
	if t.stale > t.minStale && t.stale > len(t.heap)-t.stale {
		t.compact()
	}
}

func (t *table) freeSlot(i int32) {
	s := &t.slots[i]
	*s = slot{gen: s.gen + 1}
	t.free = append(t.free, i)
	t.live--
}

func (t *table) valid(e entry) bool { return uint32(t.slots[e.slot].gen) == e.gen }

// queuedLen is the number of live entries in the heap.
func (t *table) queuedLen() int { return len(t.heap) - t.stale }

// push schedules slot i, which must not be queued, at due.
func (t *table) push(i int32, due int64) {
	s := &t.slots[i]
	s.queued = true
	e := entry{due: due, slot: i, gen: uint32(s.gen)}
	t.heap = append(t.heap, e)
	t.up(len(t.heap)-1, e)
}

// peek returns the earliest live entry, dropping the stale ones above it.
func (t *table) peek() (entry, bool) {
	for len(t.heap) > 0 {
		e := t.heap[0]
		if t.valid(e) {
			return e, true
		}
		t.stale--
		t.removeTop()
	}
	return entry{}, false
}

// pop unschedules the entry peek returned.
func (t *table) pop() {
	t.slots[t.heap[0].slot].queued = false
	t.removeTop()
}

// clear frees every queued slot and empties the heap.
func (t *table) clear() {
	for _, e := range t.heap {
		if t.valid(e) {
			t.freeSlot(e.slot)
		}
	}
	t.heap = nil
	t.stale = 0
}

// compact drops the stale entries and restores the heap order.
func (t *table) compact() {
	kept := t.heap[:0]
	for _, e := range t.heap {
		if t.valid(e) {
			kept = append(kept, e)
		}
	}
	t.heap = kept
	t.stale = 0
	for i := len(kept)/2 - 1; i >= 0; i-- {
		t.down(i)
	}
}

func (t *table) removeTop() {
	n := len(t.heap) - 1
	t.heap[0] = t.heap[n]
	t.heap = t.heap[:n]
	if n > 0 {
		t.down(0)
	}
}

// up moves e, the entry at i, towards the top until its parent is not
// later. Leases started with the same interval come due in the order they
// are started, so a push usually stops at the first comparison. (e is passed
// in rather than read back: reading an entry just stored stalls the load.)
func (t *table) up(i int, e entry) {
	h := t.heap
	for i > 0 {
		p := (i - 1) / 2
		if h[p].due <= e.due {
			break
		}
		h[i] = h[p]
		i = p
	}
	h[i] = e
}

// down moves the entry at i away from the top until no child is earlier.
func (t *table) down(i int) {
	h := t.heap
	n := len(h)
	e := h[i]
	for {
		c := 2*i + 1
		if c >= n || c < 0 {
			break
		}
		if r := c + 1; r < n && h[r].due < h[c].due {
			c = r
		}
		if h[c].due >= e.due {
			break
		}
		h[i] = h[c]
		i = c
	}
	h[i] = e
}
