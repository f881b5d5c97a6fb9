package lease

import (
	"cmp"
	"slices"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// idleKeeper is a keeper whose scheduler is not running: the tests drive
// takeDue themselves, with made-up clock readings.
func idleKeeper(t *testing.T, cfg Config) *Keeper {
	t.Helper()
	k, err := New(&recorder{}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// at is a receipt time t after the keeper's epoch.
func (k *Keeper) at(t time.Duration) time.Time { return k.epoch.Add(t) }

// taken calls takeDue at tick now and returns the deliveries it took for
// renewal, giving the leases back as a stopping keeper does.
func (k *Keeper) taken(now time.Duration) []*adapters.Delivery {
	batches, _ := k.takeDue(int64(now))
	var ds []*adapters.Delivery
	k.mu.Lock()
	for _, b := range batches {
		for _, i := range b.slots {
			ds = append(ds, k.t.slots[i].d)
		}
	}
	k.mu.Unlock()
	for _, b := range batches {
		k.abandon(b)
	}
	return ds
}

// TestStoppedLeaseIsNotTaken: Stop leaves the lease's heap entry behind;
// the scheduler must skip it, not renew the stopped delivery.
func TestStoppedLeaseIsNotTaken(t *testing.T) {
	k := idleKeeper(t, Config{Lease: time.Hour})
	a := &adapters.Delivery{ID: "a", ReceivedAt: k.at(0)}
	b := &adapters.Delivery{ID: "b", ReceivedAt: k.at(time.Second)}
	la := k.Track(a)
	k.Track(b)
	la.Stop()
	if n := len(k.t.heap); n != 2 {
		t.Fatalf("heap holds %d entries; Stop was meant to leave its entry behind", n)
	}
	got := k.taken(2 * time.Hour)
	if len(got) != 1 || got[0] != b {
		t.Fatalf("took %v for renewal, want only b", got)
	}
}

// TestStopOfAnOldLeaseSparesTheSlotsNextOwner: slots are reused once
// freed; stopping a lease again (the runtime may) must not stop the lease
// that now has its slot.
func TestStopOfAnOldLeaseSparesTheSlotsNextOwner(t *testing.T) {
	k := idleKeeper(t, Config{Lease: time.Hour})
	old := k.Track(&adapters.Delivery{ID: "old", ReceivedAt: k.at(0)})
	old.Stop()
	d := &adapters.Delivery{ID: "new", ReceivedAt: k.at(0)}
	l := k.Track(d)
	if l.slot != old.slot {
		t.Fatalf("the freed slot %d was not reused (got %d): the test checks nothing", old.slot, l.slot)
	}
	old.Stop()
	if n := k.Len(); n != 1 {
		t.Fatalf("Len() = %d after a second Stop of an old lease, want 1", n)
	}
	if got := k.taken(2 * time.Hour); len(got) != 1 || got[0] != d {
		t.Fatalf("took %v for renewal, want the new lease", got)
	}
}

// TestReusedLeaseRunsOnItsOwnSchedule: a Lease value stopped and started
// again for a later delivery falls due when that delivery does; the entry
// its first use left in the heap must not take it early.
func TestReusedLeaseRunsOnItsOwnSchedule(t *testing.T) {
	k := idleKeeper(t, Config{Lease: time.Hour}) // renewed after 20 minutes
	var l Lease
	k.Start(&l, &adapters.Delivery{ID: "first", ReceivedAt: k.at(0)})
	l.Stop()
	second := &adapters.Delivery{ID: "second", ReceivedAt: k.at(30 * time.Minute)}
	k.Start(&l, second)
	if got := k.taken(25 * time.Minute); len(got) != 0 {
		t.Fatalf("took %d lease(s) at +25m; the reused lease falls due at +50m", len(got))
	}
	if got := k.taken(50 * time.Minute); len(got) != 1 || got[0] != second {
		t.Fatalf("took %v at +50m, want the second delivery", got)
	}
}

// TestStoppedEntriesAreCompacted: entries left behind by Stop are dropped
// once they outnumber the live ones, so the heap stays within twice the
// live leases (plus minStale) however many leases come and go.
func TestStoppedEntriesAreCompacted(t *testing.T) {
	k := idleKeeper(t, Config{Lease: time.Hour})
	var ring [10]Lease
	for i := range 100_000 {
		l := &ring[i%len(ring)]
		l.Stop()
		k.Start(l, &adapters.Delivery{ReceivedAt: k.at(time.Duration(i))})
		if n, live := len(k.t.heap), k.Len(); n > 2*live+minStale {
			t.Fatalf("after %d leases: heap of %d entries for %d live leases", i+1, n, live)
		}
	}
	if n := len(k.t.slots); n > len(ring)+1 {
		t.Fatalf("%d slots for %d live leases: freed slots are not reused", n, len(ring))
	}
	// The order survives compaction: the live leases come due oldest first.
	batches, _ := k.takeDue(int64(2 * time.Hour))
	var got []time.Time
	k.mu.Lock()
	for _, b := range batches {
		for _, i := range b.slots {
			got = append(got, k.t.slots[i].d.ReceivedAt)
		}
	}
	k.mu.Unlock()
	if len(got) != len(ring) || !slices.IsSortedFunc(got, time.Time.Compare) {
		t.Fatalf("took %d leases, want %d in order: %v", len(got), len(ring), got)
	}
}

// TestCompactionKeepsTheHeapOrder: compaction drops entries from anywhere
// in the heap, which leaves the rest out of order; it must restore it.
func TestCompactionKeepsTheHeapOrder(t *testing.T) {
	tb := table{minStale: 0}
	const n = 1000
	var slots []int32
	for i := range n {
		s := tb.alloc()
		tb.push(s, int64(i*7919%n)) // every due time once, shuffled
		slots = append(slots, s)
	}
	for i, s := range slots {
		if i%3 != 0 {
			tb.release(s)
		}
	}
	if len(tb.heap) >= n-n/3 {
		t.Fatalf("heap of %d after %d stops: no compaction, the test checks nothing", len(tb.heap), n-n/3)
	}
	var got []int64
	for {
		e, ok := tb.peek()
		if !ok {
			break
		}
		tb.pop()
		got = append(got, e.due)
	}
	if len(got) != (n+2)/3 || !slices.IsSorted(got) {
		t.Fatalf("took %d entries (want %d), sorted %v", len(got), (n+2)/3, slices.IsSorted(got))
	}
}

// TestStartPokesOnlyForAnEarlierDueTime: StartAll wakes the scheduler only
// when a lease falls due before everything it already waits for.
func TestStartPokesOnlyForAnEarlierDueTime(t *testing.T) {
	k := idleKeeper(t, Config{Lease: time.Hour})
	poked := func() bool {
		select {
		case <-k.wake:
			return true
		default:
			return false
		}
	}
	k.Track(&adapters.Delivery{ReceivedAt: k.at(time.Minute)})
	if !poked() {
		t.Fatal("the first lease did not wake the scheduler")
	}
	k.Track(&adapters.Delivery{ReceivedAt: k.at(2 * time.Minute)})
	if poked() {
		t.Fatal("a lease due after the earliest one woke the scheduler")
	}
	k.Track(&adapters.Delivery{ReceivedAt: k.at(0)})
	if !poked() {
		t.Fatal("a lease due before the earliest one did not wake the scheduler")
	}
	// The scheduler looked (and will wake at the earliest due time): a
	// lease due later needs no wake-up, one due earlier does.
	k.takeDue(0)
	k.Track(&adapters.Delivery{ReceivedAt: k.at(time.Second)})
	if poked() {
		t.Fatal("a lease due after the one the scheduler waits for woke it")
	}
}

// TestStartAllDoesNotAllocate: tracking a batch costs no allocation of the
// keeper's own once its tables have grown (the runtime calls it per batch).
func TestStartAllDoesNotAllocate(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	k := idleKeeper(t, Config{Lease: time.Hour})
	ds := make([]*adapters.Delivery, 10)
	for i := range ds {
		ds[i] = &adapters.Delivery{ReceivedAt: k.at(time.Second)}
	}
	leases := make([]Lease, len(ds))
	seq := func(yield func(*Lease, *adapters.Delivery) bool) {
		for i, d := range ds {
			if !yield(&leases[i], d) {
				return
			}
		}
	}
	allocs := testing.AllocsPerRun(1000, func() {
		k.StartAll(seq)
		for i := range leases {
			leases[i].Stop()
		}
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per StartAll of 10 leases and their Stops", allocs)
	}
}

// tableModel is the reference for the table: the due time of every queued
// handle, and the handles taken off the heap and not yet given back.
type tableModel struct {
	queued map[handle]int64
	held   []handle
}

type handle struct {
	slot int32
	gen  uint64
}

// FuzzTable drives the table (heap, lazy removal, compaction, slot reuse)
// and a map of due times with the same operations and compares them after
// every step: the earliest due time, the order entries are taken in, the
// live counts, the heap's order and its bound.
func FuzzTable(f *testing.F) {
	f.Add([]byte{0, 4, 8, 1, 2, 3, 0, 0, 5, 9, 2, 7, 3})
	f.Add([]byte{0, 0, 0, 0, 1, 1, 1, 6, 2, 3, 11, 2, 255, 254, 253})
	ops := make([]byte, 600)
	for i := range ops {
		ops[i] = byte(i * 37 % 251)
	}
	f.Add(ops)
	f.Fuzz(func(t *testing.T, ops []byte) {
		var tb table
		if len(ops) > 0 {
			// Low thresholds, so that short runs compact too.
			tb.minStale, ops = int(ops[0]%8), ops[1:]
		}
		m := tableModel{queued: map[handle]int64{}}
		var clock int64
		pick := func(op byte) (handle, bool) {
			if len(m.queued) == 0 {
				return handle{}, false
			}
			hs := make([]handle, 0, len(m.queued))
			for h := range m.queued {
				hs = append(hs, h)
			}
			slices.SortFunc(hs, func(a, b handle) int { return cmp.Compare(a.slot, b.slot) })
			return hs[int(op>>2)%len(hs)], true
		}
		for step, op := range ops {
			switch op % 4 {
			case 0: // start a lease due soon; many share a due time
				i := tb.alloc()
				due := clock + int64(op>>4)
				tb.push(i, due)
				m.queued[handle{i, tb.slots[i].gen}] = due
			case 1: // stop a queued lease
				h, ok := pick(op)
				if !ok {
					continue
				}
				tb.release(h.slot)
				delete(m.queued, h)
			case 2: // the scheduler takes everything due by a later clock
				clock += int64(op >> 5)
				var want []int64
				for _, due := range m.queued {
					if due <= clock {
						want = append(want, due)
					}
				}
				slices.Sort(want)
				var got []int64
				for {
					e, ok := tb.peek()
					if !ok || e.due > clock {
						break
					}
					h := handle{e.slot, tb.slots[e.slot].gen}
					if due, ok := m.queued[h]; !ok || due != e.due {
						t.Fatalf("step %d: took slot %d due %d; model has it at %d (queued %v)", step, e.slot, e.due, due, ok)
					}
					tb.pop()
					delete(m.queued, h)
					m.held = append(m.held, h)
					got = append(got, e.due)
				}
				if !slices.Equal(got, want) {
					t.Fatalf("step %d: took due times %v, model %v", step, got, want)
				}
			case 3: // a renewal returns: requeue the lease, or free it
				if len(m.held) == 0 {
					continue
				}
				n := int(op>>3) % len(m.held)
				h := m.held[n]
				m.held = slices.Delete(m.held, n, n+1)
				if op&4 != 0 {
					tb.release(h.slot)
				} else {
					due := clock + int64(op>>4)
					tb.push(h.slot, due)
					m.queued[h] = due
				}
			}
			checkTable(t, step, &tb, &m)
		}
		tb.clear()
		if tb.live != len(m.held) || len(tb.heap) != 0 {
			t.Fatalf("after clear: %d live, %d entries; want %d and 0", tb.live, len(tb.heap), len(m.held))
		}
	})
}

func checkTable(t *testing.T, step int, tb *table, m *tableModel) {
	t.Helper()
	if n := tb.queuedLen(); n != len(m.queued) {
		t.Fatalf("step %d: %d queued, model %d", step, n, len(m.queued))
	}
	if tb.live != len(m.queued)+len(m.held) {
		t.Fatalf("step %d: %d live slots, model %d", step, tb.live, len(m.queued)+len(m.held))
	}
	if len(tb.heap) > 2*tb.live+tb.minStale {
		t.Fatalf("step %d: heap of %d for %d live", step, len(tb.heap), tb.live)
	}
	stale := 0
	for i, e := range tb.heap {
		if i > 0 && tb.heap[(i-1)/2].due > e.due {
			t.Fatalf("step %d: heap order broken at %d", step, i)
		}
		if !tb.valid(e) {
			stale++
		} else if due, ok := m.queued[handle{e.slot, tb.slots[e.slot].gen}]; !ok || due != e.due {
			t.Fatalf("step %d: live entry for slot %d due %d; model %d (%v)", step, e.slot, e.due, due, ok)
		}
	}
	if stale != tb.stale {
		t.Fatalf("step %d: %d stale entries, table counts %d", step, stale, tb.stale)
	}
	if len(tb.slots) != tb.live+len(tb.free) {
		t.Fatalf("step %d: %d slots, %d live and %d free", step, len(tb.slots), tb.live, len(tb.free))
	}
	if e, ok := tb.peek(); ok != (len(m.queued) > 0) {
		t.Fatalf("step %d: peek found %v, model has %d queued", step, ok, len(m.queued))
	} else if ok {
		earliest := int64(never)
		for _, due := range m.queued {
			earliest = min(earliest, due)
		}
		if e.due != earliest {
			t.Fatalf("step %d: earliest due %d, model %d", step, e.due, earliest)
		}
	}
}
