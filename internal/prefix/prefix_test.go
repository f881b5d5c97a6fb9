package prefix

import (
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

// FuzzTracker drives the tracker and the model with the same operations and
// compares their frontiers after every step.
func FuzzTracker(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 130, 129, 128, 4, 131})
	f.Add([]byte{7, 7, 200, 3, 255, 0, 128})
	f.Fuzz(func(t *testing.T, ops []byte) {
		tr := New()
		m := &model{done: map[int64]bool{}}
		next := int64(0)
		for _, op := range ops {
			if op < 128 {
				// Track the next position after a gap of op%4.
				next += int64(op % 4)
				okT := tr.Track(next)
				if !okT {
					t.Fatalf("Track(%d) refused an increasing position", next)
				}
				m.tracked = append(m.tracked, next)
				next++
				continue
			}
			if len(m.tracked) == 0 {
				continue
			}
			p := m.tracked[int(op-128)%len(m.tracked)]
			before, okBefore := m.frontier()
			m.done[p] = true
			after, okAfter := m.frontier()
			advanced := tr.Done(p)
			if want := okAfter && (!okBefore || after != before); advanced != want {
				t.Fatalf("Done(%d) reported advanced=%v, model says %v", p, advanced, want)
			}
			gf, gok := tr.Frontier()
			if gok != okAfter || (gok && gf != after) {
				t.Fatalf("after Done(%d): frontier = %d,%v; model %d,%v", p, gf, gok, after, okAfter)
			}
			var beyond int
			tr.DoneBeyond(func(q int64) {
				if !m.done[q] || q <= gf {
					t.Fatalf("DoneBeyond reported %d (frontier %d)", q, gf)
				}
				beyond++
			})
			want := 0
			for _, q := range m.tracked {
				if m.done[q] && (!gok || q > gf) {
					want++
				}
			}
			if beyond != want {
				t.Fatalf("DoneBeyond reported %d positions, model has %d", beyond, want)
			}
		}
	})
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
