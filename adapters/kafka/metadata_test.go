package kafka

import (
	"encoding/base64"
	"encoding/binary"
	"slices"
	"testing"

	"github.com/custody-go/custody/internal/prefix"
)

func TestMetadataRoundTrip(t *testing.T) {
	done := []int64{12, 13, 14, 20, 1000, 1001}
	m := encodeDone(10, func(fn func(int64)) {
		for _, d := range done {
			fn(d)
		}
	})
	got := decodeDone(m, 10)
	want := []span{{12, 14}, {20, 20}, {1000, 1001}}
	if !slices.Equal(got, want) {
		t.Fatalf("decoded %v, want %v (metadata %q)", got, want, m)
	}
	if decodeDone(m, 11) != nil {
		t.Fatal("metadata relative to another committed offset was used")
	}
	for _, bad := range []string{"", "kgo-member-1", metadataPrefix + "!!", metadataPrefix + "AA"} {
		if decodeDone(bad, 0) != nil {
			t.Fatalf("decoded spans from %q", bad)
		}
	}
}

// A run length past what an int64 holds is corrupt, not a run to the end of
// the partition: from offset 0 it wrapped around to the largest offset, and
// the next owner skipped every record.
func TestMetadataWithAnOverlongRunSkipsNothing(t *testing.T) {
	raw := binary.AppendUvarint(nil, 0) // base: committed offset 0
	raw = binary.AppendUvarint(raw, 0)  // the run starts at the base
	raw = binary.AppendUvarint(raw, 1<<63)
	m := metadataPrefix + base64.RawURLEncoding.EncodeToString(raw)
	if got := decodeDone(m, 0); got != nil {
		t.Fatalf("decoded %v from corrupt metadata %q, want nothing skipped", got, m)
	}
}

// FuzzMetadataBound drives a tracker with arbitrary tracking and completion
// orders, taking only what the size bound admits, and checks that the
// encoded metadata always fits the limit and decodes to exactly the done
// positions beyond the commit point.
func FuzzMetadataBound(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 200, 4, 5, 130, 131}, uint8(40), []byte{})
	f.Add([]byte{9, 9, 9, 9, 9, 255, 129, 250}, uint8(0), []byte{3, 4, 200, 9})
	f.Add([]byte{1, 2, 130, 3, 129}, uint8(10), []byte{0, 9, 1, 1, 7, 3, 250, 250, 2, 2})
	f.Fuzz(func(t *testing.T, ops []byte, lim uint8, inherited []byte) {
		limit := minMetadataLimit + int(lim)
		p := newPartition("t", 0, 1)
		p.tr = prefix.New()
		// Spans a previous owner recorded done, as pairs of (gap, length).
		for i, from := 0, int64(5); i+1 < len(inherited); i += 2 {
			from += int64(inherited[i])
			to := from + int64(inherited[i+1]%50)
			p.skip = append(p.skip, span{from, to})
			from = to + 2
		}
		next := int64(5)
		var tracked []int64
		for _, op := range ops {
			if op < 128 {
				gap := int64(op%8) * int64(1+op/8) * 37 // gaps up to a few thousand
				c := p.trackCost(next + gap)
				if !p.fits(c, limit) {
					continue
				}
				next += gap
				p.track(next, -1, c)
				tracked = append(tracked, next)
				next++
			} else if len(tracked) > 0 {
				p.done(tracked[int(op-128)%len(tracked)])
			}
			at, ok := p.commitPoint()
			if !ok {
				continue
			}
			m := p.metadata(at, limit)
			if len(m) > limit {
				t.Fatalf("metadata of %d bytes exceeds the limit %d", len(m), limit)
			}
			var want []int64
			p.tr.DoneBeyond(func(pos int64) { want = append(want, pos) })
			var got []int64
			for _, s := range decodeDone(m, at) {
				for o := s.from; o <= s.to; o++ {
					got = append(got, o)
				}
			}
			// Every done position this owner tracked, then whole spans of
			// the previous owner's beyond them, in order, as many as fit.
			if len(got) < len(want) || !slices.Equal(got[:len(want)], want) {
				t.Fatalf("metadata decodes to %v, want it to start with %v", got, want)
			}
			rest := got[len(want):]
			for _, sp := range p.skip {
				if len(rest) == 0 {
					break
				}
				from := max(sp.from, p.lastTracked+1, at)
				for o := from; o <= sp.to; o++ {
					if len(rest) == 0 || rest[0] != o {
						t.Fatalf("metadata decodes to %v: inherited span %v is not whole (tracked %v, done %v)", got, sp, tracked, want)
					}
					rest = rest[1:]
				}
			}
			if len(rest) > 0 {
				t.Fatalf("metadata decodes to %v: %v is neither done nor inherited", got, rest)
			}
		}
	})
}

func TestLeaderEpochBeforeACommitPoint(t *testing.T) {
	p := newPartition("t", 0, 1)
	for _, r := range []struct {
		off   int64
		epoch int32
	}{{5, 1}, {6, 1}, {7, 2}, {8, 3}} {
		p.track(r.off, r.epoch, 2)
	}
	// Commit points only grow within an assignment.
	for _, c := range []struct {
		at   int64
		want int32
	}{{5, -1}, {6, 1}, {7, 1}, {8, 2}, {9, 3}, {9, 3}} {
		if got := p.leaderEpochBefore(c.at); got != c.want {
			t.Errorf("leaderEpochBefore(%d) = %d, want %d", c.at, got, c.want)
		}
	}
	if len(p.epochs) != 1 {
		t.Errorf("%d epoch starts kept after committing past all but the last", len(p.epochs))
	}
}
