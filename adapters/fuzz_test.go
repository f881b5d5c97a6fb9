package adapters

import (
	"errors"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// diagnosticsKeepsRunes says that Diagnostics cuts a long error text on a
// rune boundary (a plain msg[:1024] could split a multi-byte rune and leave
// invalid UTF-8, which some header stores reject), so FuzzDiagnostics holds
// it to that.
const diagnosticsKeepsRunes = true

// FuzzDiagnostics checks adapters.Diagnostics against a reference model of
// its headers: the error text is the error's text when it fits in 1 KiB,
// else a prefix of it of at most 1 KiB (that splits no rune once
// diagnosticsKeepsRunes is set); attempts, permanence, partition and offset
// parse back to their values; times parse back to the same instant (for
// years RFC 3339 can write); empty and not-applicable values are left out.
func FuzzDiagnostics(f *testing.F) {
	f.Add("boom", true, 3, int32(-1), int64(-1), "q", "id-1", "k", "c", int64(1_700_000_000_123_456_789), int64(0), false)
	f.Add(strings.Repeat("e", 1024), false, 0, int32(0), int64(0), "", "", "", "", int64(0), int64(1), true)
	f.Add(strings.Repeat("e", 1023)+"é", false, 1, int32(2), int64(-1), "", "", "", "", int64(-1), int64(0), false)
	f.Add(strings.Repeat("e", 1022)+"€x", false, 1, int32(7), int64(99), "q", "", "", "", int64(0), int64(0), false)
	f.Add(strings.Repeat("\xff", 2000), true, -5, int32(0), int64(9), "", "", "", "", int64(math.MaxInt64), int64(0), false)
	f.Add("", false, 2, int32(1), int64(1), "", "", "", "", int64(-62135596800), int64(0), false)
	f.Fuzz(func(t *testing.T, errText string, permanent bool, attempts int, partition int32, offset int64,
		queue, id, key, consumer string, unixNano, firstDelta int64, noErr bool) {
		published := time.Unix(0, unixNano)
		if unixNano == 0 {
			published = time.Time{}
		}
		first := time.Time{}
		if firstDelta != 0 {
			first = published.Add(time.Duration(firstDelta))
		}
		last := time.Unix(1_700_000_000, 5)
		d := &Delivery{ID: id, Queue: queue, Key: key, Partition: partition, Offset: offset, PublishedAt: published}
		fail := Failure{Permanent: permanent, Attempts: attempts, Consumer: consumer, FirstFailure: first, LastFailure: last}
		if !noErr {
			fail.Err = errors.New(errText)
		}
		h := Diagnostics(d, fail)

		want := map[string]bool{HeaderPermanent: true, HeaderAttempts: true, HeaderLastFailure: true}
		if !noErr {
			want[HeaderError] = true
			got := h[HeaderError]
			switch {
			case len(errText) <= maxDiagnosticErrorSize:
				if got != errText {
					t.Fatalf("error text %q became %q", errText, got)
				}
			case len(got) > maxDiagnosticErrorSize || !strings.HasPrefix(errText, got):
				t.Fatalf("long error text became %d bytes %q, want a prefix of at most %d", len(got), got, maxDiagnosticErrorSize)
			case len(got) < maxDiagnosticErrorSize-(utf8.UTFMax-1):
				t.Fatalf("long error text cut to %d bytes, more than a rune short of %d", len(got), maxDiagnosticErrorSize)
			case utf8.ValidString(errText[:min(len(errText), maxDiagnosticErrorSize+utf8.UTFMax)]) && !validUpToLastRune(got):
				t.Fatalf("cut of valid UTF-8 damaged more than its last rune: %q", got)
			case diagnosticsKeepsRunes && utf8.ValidString(errText) && !utf8.ValidString(got):
				t.Fatalf("cut of valid UTF-8 split a rune: ...%q", got[len(got)-4:])
			}
		}
		if b, err := strconv.ParseBool(h[HeaderPermanent]); err != nil || b != permanent {
			t.Fatalf("permanent %v written %q", permanent, h[HeaderPermanent])
		}
		if n, err := strconv.Atoi(h[HeaderAttempts]); err != nil || n != attempts {
			t.Fatalf("attempts %d written %q", attempts, h[HeaderAttempts])
		}
		if partition >= 0 && offset >= 0 {
			want[HeaderOriginalPart], want[HeaderOriginalOffset] = true, true
			p, err1 := strconv.ParseInt(h[HeaderOriginalPart], 10, 32)
			o, err2 := strconv.ParseInt(h[HeaderOriginalOffset], 10, 64)
			if err1 != nil || err2 != nil || int32(p) != partition || o != offset {
				t.Fatalf("partition %d offset %d written %q %q", partition, offset, h[HeaderOriginalPart], h[HeaderOriginalOffset])
			}
		}
		for name, v := range map[string]string{HeaderOriginalQueue: queue, HeaderOriginalID: id, HeaderOriginalKey: key, HeaderConsumer: consumer} {
			if v != "" {
				want[name] = true
				if h[name] != v {
					t.Fatalf("%s %q written %q", name, v, h[name])
				}
			}
		}
		for name, at := range map[string]time.Time{HeaderFirstFailure: first, HeaderLastFailure: last, HeaderOriginalTime: published} {
			if at.IsZero() {
				continue
			}
			want[name] = true
			if y := at.UTC().Year(); y < 0 || y > 9999 {
				continue // RFC 3339 has four-digit years: only presence is checked
			}
			got, err := time.Parse(time.RFC3339Nano, h[name])
			if err != nil || !got.Equal(at) || got.Location() != time.UTC {
				t.Fatalf("%s %v written %q, reads back %v (%v)", name, at, h[name], got, err)
			}
		}
		for name := range h {
			if !want[name] {
				t.Fatalf("unexpected header %s=%q in %v", name, h[name], h)
			}
		}
		if len(h) != len(want) {
			t.Fatalf("headers %v, want the names %v", h, want)
		}
	})
}

// validUpToLastRune reports whether s is valid UTF-8 except, possibly, for an
// incomplete rune at its end.
func validUpToLastRune(s string) bool {
	for i := 0; i < utf8.UTFMax && len(s) > 0; i++ {
		if utf8.ValidString(s) {
			return true
		}
		s = s[:len(s)-1]
	}
	return utf8.ValidString(s)
}
