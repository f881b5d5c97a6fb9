package prefix

import "testing"

// TestFrontierNeverPassesAnUnfinishedPosition: several positions finished out
// of order beyond an unfinished one must not carry the frontier past it when
// the head finishes (a Kafka commit past an unfinished record loses it).
func TestFrontierNeverPassesAnUnfinishedPosition(t *testing.T) {
	tr := New()
	for p := int64(1); p <= 5; p++ {
		tr.Track(p)
	}
	tr.Done(3)
	tr.Done(4)
	tr.Done(5)
	if !tr.Done(1) {
		t.Fatal("frontier did not advance when the head finished")
	}
	if f, _ := tr.Frontier(); f != 1 {
		t.Fatalf("frontier = %d with position 2 unfinished, want 1", f)
	}
	var pending []int64
	tr.PendingBeyond(func(p int64) { pending = append(pending, p) })
	if len(pending) != 1 || pending[0] != 2 {
		t.Fatalf("pending = %v, want [2]", pending)
	}
	tr.Done(2)
	if f, _ := tr.Frontier(); f != 5 || tr.Outstanding() != 0 {
		t.Fatalf("frontier = %d outstanding = %d, want 5 and 0", f, tr.Outstanding())
	}
}

// TestTrackRefusesARepeatedPosition: a position tracked twice would sit in
// the tracker as two entries, one of which is never marked done, and hold the
// prefix back forever.
func TestTrackRefusesARepeatedPosition(t *testing.T) {
	tr := New()
	if !tr.Track(7) {
		t.Fatal("Track(7) refused")
	}
	if tr.Track(7) {
		t.Fatal("Track(7) accepted a second time")
	}
	tr.Done(7)
	if f, ok := tr.Frontier(); !ok || f != 7 || tr.Outstanding() != 0 {
		t.Fatalf("frontier = %d,%v outstanding = %d; want 7,true,0", f, ok, tr.Outstanding())
	}
}
