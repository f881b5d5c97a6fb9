package kafka

import (
	"encoding/base64"
	"encoding/binary"
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
	var raw []byte
	cursor := base
	var runStart, runEnd int64 = -1, -1
	flush := func() {
		if runStart < 0 {
			return
		}
		raw = binary.AppendUvarint(raw, uint64(runStart-cursor))
		raw = binary.AppendUvarint(raw, uint64(runEnd-runStart+1))
		cursor = runEnd + 1
	}
	each(func(pos int64) {
		if pos < cursor {
			return
		}
		if runStart >= 0 && pos == runEnd+1 {
			runEnd = pos
			return
		}
		flush()
		runStart, runEnd = pos, pos
	})
	flush()
	if len(raw) == 0 {
		return ""
	}
	head := binary.AppendUvarint(nil, uint64(base))
	return metadataPrefix + base64.RawURLEncoding.EncodeToString(append(head, raw...))
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
		if n <= 0 || length == 0 {
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
