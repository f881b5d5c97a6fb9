// Package prefix tracks out-of-order completions of ordered positions (Kafka
// offsets, AMQP delivery tags) and reports the highest position up to which
// every tracked position is done: the durable prefix that may be committed or
// acked with multiple=true.
package prefix

import "sort"

// Tracker is the completion-prefix tracker. Positions are tracked in strictly
// increasing order (gaps allowed: a gap is a position that was never polled,
// such as a compacted offset, and does not hold the prefix back). A Tracker is
// not safe for concurrent use; its owner serialises calls.
type Tracker struct {
	pos      []int64 // tracked positions not yet behind the frontier, ascending
	done     []bool  // done[i] reports whether pos[i] is done
	head     int     // index of the first live entry in pos and done
	frontier int64   // highest position released; valid when hasFront
	hasFront bool
	ndone    int // done entries at or after head
}

// New returns an empty tracker.
func New() *Tracker { return &Tracker{} }

// Track registers pos as outstanding. It reports false, and does nothing, when
// pos is not greater than every position tracked before.
func (t *Tracker) Track(pos int64) bool {
	if n := len(t.pos); n > t.head {
		if pos <= t.pos[n-1] {
			return false
		}
	} else if t.hasFront && pos <= t.frontier {
		return false
	}
	if t.head > 0 && t.head >= len(t.pos)/2 {
		t.compact()
	}
	t.pos = append(t.pos, pos)
	t.done = append(t.done, false)
	return true
}

// Done marks pos done and reports whether the frontier advanced. Marking a
// position that is not tracked, or already done, reports false and changes
// nothing.
func (t *Tracker) Done(pos int64) bool {
	live := t.pos[t.head:]
	var i int
	if len(live) == 0 || live[0] != pos {
		// In-order completion (the common case) finds pos at the head;
		// anything else is searched for.
		i = sort.Search(len(live), func(i int) bool { return live[i] >= pos })
	}
	if i == len(live) || live[i] != pos || t.done[t.head+i] {
		return false
	}
	t.done[t.head+i] = true
	t.ndone++
	if i != 0 {
		return false
	}
	for t.head < len(t.pos) && t.done[t.head] {
		t.frontier = t.pos[t.head]
		t.hasFront = true
		t.head++
		t.ndone--
	}
	if t.head == len(t.pos) {
		t.pos, t.done, t.head = t.pos[:0], t.done[:0], 0
	}
	return true
}

// Frontier returns the highest position p such that every tracked position
// up to p is done, and false when no position has been released yet.
func (t *Tracker) Frontier() (int64, bool) { return t.frontier, t.hasFront }

// Outstanding returns how many tracked positions are beyond the frontier
// (not yet done, or done but behind one that is not).
func (t *Tracker) Outstanding() int { return len(t.pos) - t.head }

// DoneBeyond calls fn, in ascending order, for every done position beyond the
// frontier.
func (t *Tracker) DoneBeyond(fn func(pos int64)) {
	if t.ndone == 0 {
		return
	}
	for i := t.head; i < len(t.pos); i++ {
		if t.done[i] {
			fn(t.pos[i])
		}
	}
}

// PendingBeyond calls fn, in ascending order, for every tracked position that
// is not done.
func (t *Tracker) PendingBeyond(fn func(pos int64)) {
	for i := t.head; i < len(t.pos); i++ {
		if !t.done[i] {
			fn(t.pos[i])
		}
	}
}

func (t *Tracker) compact() {
	n := copy(t.pos, t.pos[t.head:])
	copy(t.done, t.done[t.head:])
	t.pos, t.done, t.head = t.pos[:n], t.done[:n], 0
}
