package kafka

import (
	"encoding/base64"
	"encoding/binary"
	"math"
	"slices"
	"testing"

	"github.com/custody-go/custody/internal/prefix"
)

// done feeds encodeDone the positions of spans, each with its span's epoch.
func done(spans ...span) func(fn func(int64, int32)) {
	return func(fn func(int64, int32)) {
		for _, sp := range spans {
			for o := sp.from; o <= sp.to; o++ {
				fn(o, sp.epoch)
			}
		}
	}
}

func TestMetadataRoundTrip(t *testing.T) {
	want := []span{{12, 14, 1}, {20, 20, 1}, {21, 21, 2}, {1000, 1001, 2}, {1002, 1002, -1}, {5000, 5000, math.MaxInt32}}
	m := encodeDone(10, done(want...))
	got := decodeDone(m, 10, 7)
	if !slices.Equal(got, want) {
		t.Fatalf("decoded %v, want %v (metadata %q)", got, want, m)
	}
	if decodeDone(m, 11, 7) != nil {
		t.Fatal("metadata relative to another committed offset was used")
	}
	for _, bad := range []string{"", "kgo-member-1", metadataPrefix + "!!", metadataPrefix + "AA", legacyMetadataPrefix + "!!"} {
		if decodeDone(bad, 0, 0) != nil {
			t.Fatalf("decoded spans from %q", bad)
		}
	}
}

// legacyMetadata encodes spans in the format of the previous version: no
// epochs, each run its distance and its length.
func legacyMetadata(base int64, spans ...span) string {
	raw := binary.AppendUvarint(nil, uint64(base))
	cursor := base
	for _, sp := range spans {
		raw = binary.AppendUvarint(raw, uint64(sp.from-cursor))
		raw = binary.AppendUvarint(raw, uint64(sp.to-sp.from+1))
		cursor = sp.to + 1
	}
	return legacyMetadataPrefix + base64.RawURLEncoding.EncodeToString(raw)
}

// Metadata of the previous version (a rolling deploy has both in one group)
// is read; it records no epochs, and its spans are taken to be of the
// epoch committed with the offset.
func TestMetadataOfThePreviousVersionIsRead(t *testing.T) {
	m := legacyMetadata(100, span{from: 105, to: 110}, span{from: 120, to: 120})
	got := decodeDone(m, 100, 3)
	if want := []span{{105, 110, 3}, {120, 120, 3}}; !slices.Equal(got, want) {
		t.Fatalf("decoded %v from %q, want %v", got, m, want)
	}
}

// Corrupt metadata skips nothing.
func TestCorruptMetadataSkipsNothing(t *testing.T) {
	enc := func(prefix string, vs ...uint64) string {
		var raw []byte
		for _, v := range vs {
			raw = binary.AppendUvarint(raw, v)
		}
		return prefix + base64.RawURLEncoding.EncodeToString(raw)
	}
	for _, tc := range []struct{ what, meta string }{
		// A run length past what an int64 holds is not a run to the end
		// of the partition: from offset 0 it wrapped around to the largest
		// offset, and the next owner skipped every record.
		{"an overlong run (previous format)", enc(legacyMetadataPrefix, 0, 0, 1<<63)},
		{"a distance past an int64", enc(metadataPrefix, 0, 1<<63, 3, 1)},
		{"a run of no offsets", enc(metadataPrefix, 0, 0, 1, 1)},
		{"a first run without its epoch", enc(metadataPrefix, 0, 0, 2)},
		{"an epoch past an int32", enc(metadataPrefix, 0, 0, 3, math.MaxInt32+2)},
		{"a run cut short", enc(metadataPrefix, 0, 0, 3)},
		{"a base past an int64", enc(metadataPrefix, 1<<63, 0, 3, 1)},
	} {
		if got := decodeDone(tc.meta, 0, 0); got != nil {
			t.Errorf("%s: decoded %v from %q, want nothing skipped", tc.what, got, tc.meta)
		}
	}
}

// FuzzMetadataDecode feeds the decoder arbitrary metadata: it never panics,
// and what it accepts names ascending, disjoint runs at or beyond the
// committed offset, which encode back to metadata that decodes the same.
func FuzzMetadataDecode(f *testing.F) {
	f.Add(encodeDone(10, done(span{12, 14, 1}, span{20, 21, 2})), int64(10), int32(0))
	f.Add(legacyMetadata(5, span{from: 6, to: 9}), int64(5), int32(2))
	f.Add(metadataPrefix+"AAEB", int64(0), int32(-1))
	f.Fuzz(func(t *testing.T, meta string, committed int64, commitEpoch int32) {
		spans := decodeDone(meta, committed, commitEpoch)
		cursor := committed
		for _, sp := range spans {
			if sp.from < cursor || sp.to < sp.from || sp.epoch < -1 {
				t.Fatalf("decoded %v from %q (committed %d): runs out of order or overlapping", spans, meta, committed)
			}
			cursor = sp.to + 1
		}
		if len(spans) == 0 {
			return
		}
		e := newDoneEncoder(committed)
		for _, sp := range spans {
			e.add(sp.from, sp.to, sp.epoch)
		}
		again := decodeDone(e.String(), committed, commitEpoch+1)
		if !slices.Equal(merged(again), merged(spans)) {
			t.Fatalf("decoded %v from %q, encoded again it decodes to %v", spans, meta, again)
		}
	})
}

// merged joins adjacent spans of one epoch, as the encoder does.
func merged(spans []span) []span {
	var out []span
	for _, sp := range spans {
		if n := len(out); n > 0 && out[n-1].epoch == sp.epoch && out[n-1].to+1 == sp.from {
			out[n-1].to = sp.to
			continue
		}
		out = append(out, sp)
	}
	return out
}

// FuzzMetadataBound drives a tracker with arbitrary tracking and completion
// orders over records of growing leader epochs, taking only what the size
// bound admits, and checks that the encoded metadata always fits the limit
// and decodes to exactly the done positions beyond the commit point, each
// with its record's epoch, then whole inherited spans with theirs.
func FuzzMetadataBound(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 200, 4, 5, 130, 131}, uint8(40), []byte{})
	f.Add([]byte{9, 9, 9, 9, 9, 255, 129, 250}, uint8(0), []byte{3, 4, 200, 9})
	f.Add([]byte{1, 2, 130, 3, 129}, uint8(10), []byte{0, 9, 1, 1, 7, 3, 250, 250, 2, 2})
	f.Add([]byte{15, 1, 31, 2, 127, 3, 129, 130, 47, 4, 131, 132}, uint8(3), []byte{1, 1, 2, 2, 3, 3})
	f.Fuzz(func(t *testing.T, ops []byte, lim uint8, inherited []byte) {
		limit := minMetadataLimit + int(lim)
		p := newPartition("t", 0, 1)
		p.tr = prefix.New()
		// Spans a previous owner recorded done, as triples of (gap,
		// length, epoch step).
		for i, from, epoch := 0, int64(5), int32(-1); i+2 < len(inherited); i += 3 {
			from += int64(inherited[i])
			to := from + int64(inherited[i+1]%50)
			epoch += int32(inherited[i+2] % 3)
			p.skip = append(p.skip, span{from, to, epoch})
			from = to + 2
		}
		next, epoch := int64(5), int32(0)
		var tracked []int64
		epochOf := map[int64]int32{}
		for _, op := range ops {
			if op < 128 {
				gap := int64(op%8) * int64(1+op/8) * 37 // gaps up to a few thousand
				e := epoch
				if op%16 == 15 {
					e += 1 + int32(op)*int32(op)*1000 // up to 4-byte epochs
				}
				c := p.trackCost(next+gap, e)
				if !p.fits(c, limit) {
					continue
				}
				next += gap
				epoch = e
				p.track(next, epoch, c)
				tracked = append(tracked, next)
				epochOf[next] = epoch
				next++
			} else if len(tracked) > 0 {
				p.done(tracked[int(op-128)%len(tracked)])
			}
			at, ok := p.commitPoint()
			if !ok {
				continue
			}
			p.leaderEpochBefore(at) // as a commit does, which forgets older epochs
			m := p.metadata(at, limit)
			if len(m) > limit {
				t.Fatalf("metadata of %d bytes exceeds the limit %d", len(m), limit)
			}
			var want []span
			p.tr.DoneBeyond(func(pos int64) { want = append(want, span{pos, pos, epochOf[pos]}) })
			var got []span
			for _, s := range decodeDone(m, at, -1) {
				for o := s.from; o <= s.to; o++ {
					got = append(got, span{o, o, s.epoch})
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
					if len(rest) == 0 || rest[0] != (span{o, o, sp.epoch}) {
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

// A previous owner's spans are skipped only where the records' leader epoch
// is the recorded one. A record of another epoch inside a span, or of a
// later epoch than the next span's before it, shows a log rewritten since
// the spans were written: it is not skipped, and neither is any later one.
func TestSkippedMatchesOffsetAndEpoch(t *testing.T) {
	type rec struct {
		off   int64
		epoch int32
	}
	spans := []span{{105, 110, 1}, {120, 121, 2}}
	for _, tc := range []struct {
		name string
		recs []rec
		want []int64 // offsets skipped
	}{
		{"same log", []rec{{104, 1}, {105, 1}, {110, 1}, {111, 2}, {120, 2}, {121, 2}, {122, 2}}, []int64{105, 110, 120, 121}},
		{"rewritten from the commit", []rec{{100, 2}, {105, 2}, {110, 2}, {120, 2}}, nil},
		{"rewritten inside a span", []rec{{105, 1}, {106, 3}, {107, 3}, {120, 3}}, []int64{105}},
		{"an older epoch inside a span", []rec{{105, 0}, {106, 1}, {120, 2}}, nil},
		{"rewritten between spans", []rec{{105, 1}, {110, 1}, {115, 3}, {120, 3}}, []int64{105, 110}},
		{"a later epoch before a span of that epoch", []rec{{111, 2}, {120, 2}}, []int64{120}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPartition("t", 0, 1)
			p.skip = slices.Clone(spans)
			var got []int64
			for _, r := range tc.recs {
				if p.skipped(r.off, r.epoch) {
					got = append(got, r.off)
				}
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("skipped %v, want %v", got, tc.want)
			}
		})
	}
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
