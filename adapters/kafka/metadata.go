package kafka

import (
	"encoding/base64"
	"encoding/binary"
	"math"
	"strings"
)

// Commit metadata carries the done offsets beyond the committed one, with
// the leader epoch of their records (see the package documentation, section
// Commits): an offset alone does not name a record once an unclean leader
// election rewrote the log, but Kafka's replication keeps one record per
// offset and leader epoch.
//
// Format: metadataPrefix, then unpadded URL-safe base64 of a sequence of
// unsigned varints: the committed offset the list is relative to (a reader
// ignores a list whose base is not the committed offset it fetched, which
// happens when someone else committed in between), then for each run of
// consecutive done offsets of one leader epoch: the distance from the end of
// the previous run (or from the base) to its first offset; its length times
// two, plus one when the run's leader epoch follows; and then, if it does,
// the epoch plus one (0 for -1, unknown). The first run always carries its
// epoch; a run without one has the epoch of the run before it. Base64
// because brokers store metadata as a UTF-8 string.
const metadataPrefix = "custody2:"

// legacyMetadataPrefix starts the format written before the epochs were
// recorded: the same varints without the epoch flag and the epochs (each
// run is its distance and its length). Readers still accept it, since a
// group under a rolling deploy has members of both versions; its runs are
// taken to hold records of the commit's own leader epoch (see decodeDone).
// The members of the older version ignore the current format (the prefix
// differs), so a partition they take over from a newer member runs its done
// records again: duplicates, never a record skipped.
const legacyMetadataPrefix = "custody1:"

// span is an inclusive range of done offsets whose records were written
// under one leader epoch (-1: unknown).
type span struct {
	from, to int64
	epoch    int32
}

// doneEncoder builds the metadata from done spans added in ascending order,
// merging adjacent ones of one epoch into one run.
type doneEncoder struct {
	head   []byte // the base
	raw    []byte // the runs written so far
	cursor int64  // the first offset the next run may start at
	epoch  int32  // the epoch of the last run written, if any
	run    span   // the run being built, if open
	open   bool
}

func newDoneEncoder(base int64) *doneEncoder {
	return &doneEncoder{head: binary.AppendUvarint(nil, uint64(base)), cursor: base}
}

// add records the inclusive span [from, to] of records of leader epoch
// epoch. Offsets below what was already added are ignored.
func (e *doneEncoder) add(from, to int64, epoch int32) {
	epoch = max(epoch, -1) // the only negative epoch is -1, unknown
	if e.open && epoch == e.run.epoch && from <= e.run.to+1 {
		e.run.to = max(e.run.to, to)
		return
	}
	e.flush()
	from = max(from, e.cursor)
	if from > to {
		return
	}
	e.run, e.open = span{from, to, epoch}, true
}

// runHead returns the varints of the open run: its distance, its length
// field and whether its epoch follows.
func (e *doneEncoder) runHead() (gap, length uint64, withEpoch bool) {
	withEpoch = len(e.raw) == 0 || e.run.epoch != e.epoch
	length = uint64(e.run.to-e.run.from+1) << 1
	if withEpoch {
		length |= 1
	}
	return uint64(e.run.from - e.cursor), length, withEpoch
}

func (e *doneEncoder) flush() {
	if !e.open {
		return
	}
	gap, length, withEpoch := e.runHead()
	e.raw = binary.AppendUvarint(e.raw, gap)
	e.raw = binary.AppendUvarint(e.raw, length)
	if withEpoch {
		e.raw = binary.AppendUvarint(e.raw, epochField(e.run.epoch))
	}
	e.epoch = e.run.epoch
	e.cursor = e.run.to + 1
	e.open = false
}

// epochField is how a leader epoch is encoded: plus one, so that -1
// (unknown, the only negative epoch) is 0.
func epochField(epoch int32) uint64 { return uint64(int64(max(epoch, -1)) + 1) }

// size is the number of varint bytes the metadata would hold if finished
// now, or 0 when it would be empty.
func (e *doneEncoder) size() int {
	n := len(e.raw)
	if e.open {
		gap, length, withEpoch := e.runHead()
		n += uvarintLen(gap) + uvarintLen(length)
		if withEpoch {
			n += uvarintLen(epochField(e.run.epoch))
		}
	}
	if n == 0 {
		return 0
	}
	return len(e.head) + n
}

// tryAdd adds [from, to] of epoch if the metadata still fits limit
// afterwards, and reports whether it did.
func (e *doneEncoder) tryAdd(from, to int64, epoch int32, limit int) bool {
	saved, savedLen := *e, len(e.raw)
	e.add(from, to, epoch)
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

// decodeDone returns the done spans recorded in meta when they are relative
// to committed, and nil otherwise (no metadata, someone else's metadata, a
// different base, or a corrupt encoding: all mean "skip nothing").
// commitEpoch is the leader epoch committed with the offset; the legacy
// format records no epochs, and its spans get commitEpoch: the records
// beyond a commit are of its epoch or a later one, so a leader change
// between the commit and the spans makes the next owner run them again
// (duplicates), and a log rewritten under a newer epoch is never skipped.
func decodeDone(meta string, committed int64, commitEpoch int32) []span {
	if committed < 0 {
		return nil
	}
	commitEpoch = max(commitEpoch, -1) // the only negative epoch is -1, unknown
	legacy := false
	rest, ok := strings.CutPrefix(meta, metadataPrefix)
	if !ok {
		if rest, ok = strings.CutPrefix(meta, legacyMetadataPrefix); !ok {
			return nil
		}
		legacy = true
	}
	raw, err := base64.RawURLEncoding.DecodeString(rest)
	if err != nil {
		return nil
	}
	base, n := binary.Uvarint(raw)
	if n <= 0 || base > math.MaxInt64 || int64(base) != committed {
		return nil
	}
	raw = raw[n:]
	cursor := committed
	epoch, haveEpoch := commitEpoch, legacy
	var spans []span
	next := func() (uint64, bool) {
		v, n := binary.Uvarint(raw)
		if n <= 0 {
			return 0, false
		}
		raw = raw[n:]
		return v, true
	}
	for len(raw) > 0 {
		gap, ok1 := next()
		length, ok2 := next()
		if !ok1 || !ok2 {
			return nil
		}
		if !legacy {
			withEpoch := length&1 == 1
			length >>= 1
			if withEpoch {
				v, ok := next()
				// An epoch field beyond an int32 (plus one) is corrupt.
				if !ok || v > math.MaxInt32+1 {
					return nil
				}
				epoch, haveEpoch = int32(int64(v)-1), true
			}
			if !haveEpoch {
				return nil // the first run must say its epoch
			}
		}
		// A length beyond an int64 is corrupt: converted, it wraps, and
		// from offset 0 the run would end at the largest offset.
		if length == 0 || length > math.MaxInt64 || gap > math.MaxInt64 {
			return nil
		}
		from := cursor + int64(gap)
		to := from + int64(length) - 1
		if from < cursor || to < from { // overflow
			return nil
		}
		spans = append(spans, span{from, to, epoch})
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
