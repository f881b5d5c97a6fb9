package kafka

import (
	"encoding/base64"
	"encoding/binary"
	"math"
	"strings"
)

// Commit metadata carries the offsets beyond the committed one that are
// already done, so that a partition's next owner does not run them again.
//
// Format: metadataPrefix, then unpadded URL-safe base64 of a sequence of
// unsigned varints: the committed offset the list is relative to (a reader
// ignores a list whose base is not the committed offset it fetched, which
// happens when someone else committed in between), then for each run of
// consecutive done offsets the distance from the end of the previous run (or
// from the base) to its first offset, and its length. Base64 because brokers
// store metadata as a UTF-8 string.
const metadataPrefix = "custody1:"

// span is an inclusive range of done offsets.
type span struct{ from, to int64 }

// encodeDone encodes the done offsets given in ascending order by each (all at
// or beyond base). It returns "" when there is nothing to record.
func encodeDone(base int64, each func(fn func(pos int64))) string {
	e := newDoneEncoder(base)
	each(func(pos int64) { e.add(pos, pos) })
	return e.String()
}

// doneEncoder builds the metadata from done spans added in ascending order,
// merging adjacent ones into one run.
type doneEncoder struct {
	head   []byte // the base
	raw    []byte // the runs written so far
	cursor int64  // the first offset the next run may start at
	run    span   // the run being built, if open
	open   bool
}

func newDoneEncoder(base int64) *doneEncoder {
	return &doneEncoder{head: binary.AppendUvarint(nil, uint64(base)), cursor: base}
}

// add records the inclusive span [from, to]. Offsets below what was already
// added are ignored.
func (e *doneEncoder) add(from, to int64) {
	if e.open && from <= e.run.to+1 {
		e.run.to = max(e.run.to, to)
		return
	}
	e.flush()
	from = max(from, e.cursor)
	if from > to {
		return
	}
	e.run, e.open = span{from, to}, true
}

func (e *doneEncoder) flush() {
	if !e.open {
		return
	}
	e.raw = binary.AppendUvarint(e.raw, uint64(e.run.from-e.cursor))
	e.raw = binary.AppendUvarint(e.raw, uint64(e.run.to-e.run.from+1))
	e.cursor = e.run.to + 1
	e.open = false
}

// size is the number of varint bytes the metadata would hold if finished
// now, or 0 when it would be empty.
func (e *doneEncoder) size() int {
	n := len(e.raw)
	if e.open {
		n += uvarintLen(uint64(e.run.from-e.cursor)) + uvarintLen(uint64(e.run.to-e.run.from+1))
	}
	if n == 0 {
		return 0
	}
	return len(e.head) + n
}

// tryAdd adds [from, to] if the metadata still fits limit afterwards, and
// reports whether it did.
func (e *doneEncoder) tryAdd(from, to int64, limit int) bool {
	saved, savedLen := *e, len(e.raw)
	e.add(from, to)
	if metadataFits(e.size(), limit) {
		return true
	}
	*e = saved
	e.raw = e.raw[:savedLen]
	return false
}

// String finishes the metadata; "" when no span was added.
func (e *doneEncoder) String() string {
	e.flush()
	if len(e.raw) == 0 {
		return ""
	}
	return metadataPrefix + base64.RawURLEncoding.EncodeToString(append(e.head, e.raw...))
}

// decodeDone returns the done spans recorded in meta when they are relative to
// committed, and nil otherwise (no metadata, someone else's metadata, a
// different base, or a corrupt encoding: all mean "skip nothing").
func decodeDone(meta string, committed int64) []span {
	rest, ok := strings.CutPrefix(meta, metadataPrefix)
	if !ok || committed < 0 {
		return nil
	}
	raw, err := base64.RawURLEncoding.DecodeString(rest)
	if err != nil {
		return nil
	}
	base, n := binary.Uvarint(raw)
	if n <= 0 || int64(base) != committed {
		return nil
	}
	raw = raw[n:]
	cursor := committed
	var spans []span
	for len(raw) > 0 {
		gap, n := binary.Uvarint(raw)
		if n <= 0 {
			return nil
		}
		raw = raw[n:]
		length, n := binary.Uvarint(raw)
		// A length beyond an int64 is corrupt: converted, it wraps, and
		// from offset 0 the run would end at the largest offset.
		if n <= 0 || length == 0 || length > math.MaxInt64 {
			return nil
		}
		raw = raw[n:]
		from := cursor + int64(gap)
		to := from + int64(length) - 1
		if from < cursor || to < from { // overflow
			return nil
		}
		spans = append(spans, span{from, to})
		cursor = to + 1
	}
	return spans
}

// uvarintLen is the encoded size of v as an unsigned varint.
func uvarintLen(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}

// metadataFits reports whether raw varint bytes fit limit once prefixed and
// base64-encoded.
func metadataFits(raw, limit int) bool {
	return len(metadataPrefix)+base64.RawURLEncoding.EncodedLen(raw) <= limit
}
