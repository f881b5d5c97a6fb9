package prefix

import (
	"math"
	"slices"
	"testing"
)

// model is the obviously correct reference: a set of tracked positions and a
// set of done ones; the frontier is the largest tracked position all of whose
// tracked predecessors (and itself) are done.
type model struct {
	tracked []int64
	done    map[int64]bool
}

func (m *model) frontier() (int64, bool) {
	var f int64
	ok := false
	for _, p := range m.tracked {
		if !m.done[p] {
			break
		}
		f, ok = p, true
	}
	return f, ok
}

func TestOutOfOrder(t *testing.T) {
	tr := New()
	for p := int64(10); p < 15; p++ {
		tr.Track(p)
	}
	if _, ok := tr.Frontier(); ok {
		t.Fatal("frontier before anything is done")
	}
	if tr.Done(12) || tr.Done(11) {
		t.Fatal("frontier advanced past unfinished 10")
	}
	if !tr.Done(10) {
		t.Fatal("frontier did not advance when the head finished")
	}
	if f, _ := tr.Frontier(); f != 12 {
		t.Fatalf("frontier = %d, want 12", f)
	}
	var beyond []int64
	tr.Done(14)
	tr.DoneBeyond(func(p int64) { beyond = append(beyond, p) })
	if len(beyond) != 1 || beyond[0] != 14 {
		t.Fatalf("done beyond = %v, want [14]", beyond)
	}
	if tr.Done(14) || tr.Done(99) || tr.Done(10) {
		t.Fatal("repeated or unknown completion changed the tracker")
	}
	tr.Done(13)
	if f, _ := tr.Frontier(); f != 14 || tr.Outstanding() != 0 {
		t.Fatalf("frontier = %d outstanding = %d, want 14 and 0", f, tr.Outstanding())
	}
}

func TestGapsDoNotHoldThePrefix(t *testing.T) {
	tr := New()
	tr.Track(5)
	tr.Track(9) // 6..8 were compacted away and never polled
	tr.Done(9)
	tr.Done(5)
	if f, _ := tr.Frontier(); f != 9 {
		t.Fatalf("frontier = %d, want 9", f)
	}
	if tr.Track(9) || tr.Track(3) {
		t.Fatal("tracked a position at or behind the frontier")
	}
}

// FuzzTracker drives the tracker and the model with the same operations
// (Track of increasing, repeated and decreasing positions; Done of tracked,
// repeated, released and never tracked positions), starting anywhere in the
// int64 range, and compares every result and every query (Frontier,
// Outstanding, DoneBeyond, PendingBeyond) with the model's after every step.
func FuzzTracker(f *testing.F) {
	f.Add(int64(0), []byte{0, 1, 2, 3, 130, 129, 128, 4, 131})
	f.Add(int64(0), []byte{7, 7, 200, 3, 255, 0, 128})
	f.Add(int64(-5), []byte{0, 64, 65, 96, 128, 97, 1, 2, 130, 129, 66, 131, 100})
	f.Add(int64(math.MaxInt64-40), []byte{0, 3, 3, 129, 128, 130, 64, 3, 99, 131})
	f.Fuzz(func(t *testing.T, start int64, ops []byte) {
		// Keep every position the run can make within int64.
		if limit := int64(math.MaxInt64) - 4*int64(len(ops)) - 8; start > limit {
			start = limit
		}
		if start < math.MinInt64+8 {
			start = math.MinInt64 + 8
		}
		tr := New()
		m := &model{done: map[int64]bool{}}
		next := start
		last := func() (int64, bool) {
			if len(m.tracked) == 0 {
				return 0, false
			}
			return m.tracked[len(m.tracked)-1], true
		}
		for step, op := range ops {
			switch {
			case op < 64:
				// Track the next position after a gap of op%4.
				next += int64(op % 4)
				if !tr.Track(next) {
					t.Fatalf("step %d: Track(%d) refused an increasing position", step, next)
				}
				m.tracked = append(m.tracked, next)
				next++
			case op < 96:
				// Track a position at or behind the last one: refused,
				// and nothing changes.
				p, ok := last()
				if !ok {
					continue
				}
				p -= int64(op % 8)
				if tr.Track(p) {
					t.Fatalf("step %d: Track(%d) accepted, last tracked %d", step, p, m.tracked[len(m.tracked)-1])
				}
			case op < 128:
				// Done of a position never tracked: a gap, one before the
				// first, or one beyond the last.
				base, ok := last()
				if !ok {
					base = start
				}
				p := base - int64(op%16) + 4
				if slices.Contains(m.tracked, p) {
					continue
				}
				if tr.Done(p) {
					t.Fatalf("step %d: Done(%d) of an untracked position advanced the frontier", step, p)
				}
			default:
				// Done of a tracked position, perhaps done already or
				// behind the frontier.
				if len(m.tracked) == 0 {
					continue
				}
				p := m.tracked[int(op-128)%len(m.tracked)]
				before, okBefore := m.frontier()
				m.done[p] = true
				after, okAfter := m.frontier()
				advanced := tr.Done(p)
				if want := okAfter && (!okBefore || after != before); advanced != want {
					t.Fatalf("step %d: Done(%d) reported advanced=%v, model says %v", step, p, advanced, want)
				}
			}
			m.check(t, step, tr)
		}
	})
}

// check compares every query of tr with the model.
func (m *model) check(t *testing.T, step int, tr *Tracker) {
	t.Helper()
	mf, mok := m.frontier()
	gf, gok := tr.Frontier()
	if gok != mok || (gok && gf != mf) {
		t.Fatalf("step %d: frontier = %d,%v; model %d,%v", step, gf, gok, mf, mok)
	}
	var wantDone, wantPending []int64
	outstanding := 0
	for _, q := range m.tracked {
		if mok && q <= mf {
			continue
		}
		outstanding++
		if m.done[q] {
			wantDone = append(wantDone, q)
		} else {
			wantPending = append(wantPending, q)
		}
	}
	if n := tr.Outstanding(); n != outstanding {
		t.Fatalf("step %d: Outstanding() = %d, model %d", step, n, outstanding)
	}
	var gotDone, gotPending []int64
	tr.DoneBeyond(func(q int64) { gotDone = append(gotDone, q) })
	tr.PendingBeyond(func(q int64) { gotPending = append(gotPending, q) })
	if !slices.Equal(gotDone, wantDone) {
		t.Fatalf("step %d: DoneBeyond = %v, model %v", step, gotDone, wantDone)
	}
	if !slices.Equal(gotPending, wantPending) {
		t.Fatalf("step %d: PendingBeyond = %v, model %v", step, gotPending, wantPending)
	}
}

func BenchmarkTrackDone(b *testing.B) {
	tr := New()
	b.ReportAllocs()
	// Completions arrive in reverse order within windows of 64, so the
	// frontier jumps by 64 once per window.
	for i := 0; i < b.N; i++ {
		tr.Track(int64(i))
		if i%64 == 63 {
			for p := int64(i); p > int64(i-64); p-- {
				tr.Done(p)
			}
		}
	}
}
