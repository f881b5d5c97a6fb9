package rabbitmq

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
)

// The fuzzers below check the adapter's pure header codecs and the delay
// ladder against reference models or round trips. Their seeds run with the
// package's tests; explore with, for example,
//
//	go test -run='^$' -fuzz=FuzzStringHeaders -fuzztime=45s ./adapters/rabbitmq/

// fieldReader turns fuzz bytes into AMQP field values of the types amqp091
// decodes from the wire (see its readField), so the fuzzer reaches every
// value a broker can deliver in a header table.
type fieldReader struct{ b []byte }

func (r *fieldReader) byte() byte {
	if len(r.b) == 0 {
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *fieldReader) uint64() uint64 {
	var buf [8]byte
	n := copy(buf[:], r.b)
	r.b = r.b[n:]
	return binary.BigEndian.Uint64(buf[:])
}

func (r *fieldReader) string() string {
	n := int(r.byte() % 24)
	n = min(n, len(r.b))
	s := string(r.b[:n])
	r.b = r.b[n:]
	return s
}

func (r *fieldReader) value(depth int) any {
	v := r.uint64()
	switch r.byte() % 18 {
	case 0:
		return r.string()
	case 1:
		return []byte(r.string())
	case 2:
		return v&1 == 1
	case 3:
		return int8(v)
	case 4:
		return uint8(v)
	case 5:
		return int16(v)
	case 6:
		return uint16(v)
	case 7:
		return int32(v)
	case 8:
		return uint32(v)
	case 9:
		return int64(v)
	case 10:
		return math.Float32frombits(uint32(v))
	case 11:
		return math.Float64frombits(v)
	case 12:
		return amqp.Decimal{Scale: uint8(v >> 32), Value: int32(v)}
	case 13:
		return time.Unix(int64(v>>1), 0) // AMQP timestamps are whole seconds
	case 14:
		return nil
	case 15:
		if depth < 3 {
			return r.table(depth + 1)
		}
		return nil
	case 16:
		if depth < 3 {
			n := int(r.byte() % 5)
			a := make([]any, n)
			for i := range a {
				a[i] = r.value(depth + 1)
			}
			return a
		}
		return nil
	default:
		return r.string()
	}
}

// table reads up to 6 entries. Keys are made valid UTF-8 and unique (an
// index suffix), so the JSON model needs no rule for colliding keys.
func (r *fieldReader) table(depth int) amqp.Table {
	n := int(r.byte() % 7)
	t := amqp.Table{}
	for i := range n {
		t[strings.ToValidUTF8(r.string(), "?")+"#"+strconv.Itoa(i)] = r.value(depth)
	}
	return t
}

// FuzzStringHeaders checks stringHeaders, the amqp.Table -> map[string]string
// conversion of delivery headers: one header per field, and each value
// readable back: text unchanged, integers and booleans parse to the same
// value, floats to the same bits (NaN to NaN), times to the same second,
// decimals to the same digits and scale, and tables and arrays as JSON that
// decodes to the reference model of the value.
func FuzzStringHeaders(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{3, 1, 'a', 0, 0, 0, 0, 0, 0, 0, 5, 0, 1, 'b', 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 9})
	f.Add([]byte{2, 1, 'x', 0x7f, 0xc0, 0, 0, 0, 0, 0, 0, 11, 1, 'y', 0, 0, 0, 0, 0, 0, 0, 0, 15, 2, 1, 'n', 0, 0, 0, 0, 0, 0, 0, 3, 12, 0, 0, 0, 0, 0, 0, 0, 0, 16, 3})
	f.Add([]byte("\x06\x02x-\x00\x00\x00\x00\x00\x00\x00\x01\x0f\x04\x01r\x00\x00\x00\x00\x00\x00\x00\x00\x00\x03\xe2\x82\xff\x00\x00\x00\x00\x00\x00\x00\x00\x01"))
	f.Add([]byte("\x01\x01t\x00\x00\x00\x00\x65\x53\xf1\x00\x0d"))
	f.Add([]byte("\x01\x01d\x00\x00\x00\x02\x80\x00\x00\x00\x0c"))
	f.Add([]byte("\x01\x01i\x00\x00\x00\x00\x00\x00\x00\x00\x10\x02\x7f\xf0\x00\x00\x00\x00\x00\x00\x0b"))
	f.Fuzz(func(t *testing.T, data []byte) {
		r := &fieldReader{b: data}
		tbl := r.table(0)
		h := stringHeaders(tbl)
		if len(tbl) == 0 {
			if h != nil {
				t.Fatalf("empty table gave %v", h)
			}
			return
		}
		if len(h) != len(tbl) {
			t.Fatalf("%d fields became %d headers", len(tbl), len(h))
		}
		for k, v := range tbl {
			s, ok := h[k]
			if !ok {
				t.Fatalf("field %q has no header", k)
			}
			checkHeaderString(t, k, v, s)
		}
	})
}

func checkHeaderString(t *testing.T, k string, v any, s string) {
	t.Helper()
	fail := func(why string) { t.Fatalf("field %q = %#v rendered %q: %s", k, v, s, why) }
	switch v := v.(type) {
	case string:
		if s != v {
			fail("text changed")
		}
	case []byte:
		if s != string(v) {
			fail("bytes changed")
		}
	case bool:
		if b, err := strconv.ParseBool(s); err != nil || b != v {
			fail("bool does not parse back")
		}
	case int8, int16, int32, int64, uint8, uint16, uint32:
		want := fmt.Sprint(v)
		if n, err := strconv.ParseInt(s, 10, 64); err != nil || strconv.FormatInt(n, 10) != want {
			fail("integer does not parse back")
		}
	case float32:
		g, err := strconv.ParseFloat(s, 32)
		if err != nil || !sameFloat(float64(float32(g)), float64(v)) {
			fail("float32 does not parse back")
		}
	case float64:
		g, err := strconv.ParseFloat(s, 64)
		if err != nil || !sameFloat(g, v) {
			fail("float64 does not parse back")
		}
	case time.Time:
		if y := v.UTC().Year(); y < 0 || y > 9999 {
			return // RFC 3339 has four-digit years; only "no panic" applies
		}
		g, err := time.Parse(time.RFC3339, s)
		if err != nil || !g.Equal(v.Truncate(time.Second)) {
			fail("time does not parse back")
		}
	case amqp.Decimal:
		digits, scale, ok := strings.Cut(s, "e-")
		n, err1 := strconv.ParseInt(digits, 10, 32)
		sc, err2 := strconv.ParseUint(scale, 10, 8)
		if !ok || err1 != nil || err2 != nil || int32(n) != v.Value || uint8(sc) != v.Scale {
			fail("decimal does not parse back")
		}
		if _, err := strconv.ParseFloat(s, 64); err != nil {
			fail("decimal is not a number")
		}
	case nil:
		if s != "" {
			fail("nil is not empty")
		}
	case amqp.Table, []any:
		if hasNonFinite(v) {
			return // JSON has no NaN or Inf; the fallback only must not panic
		}
		dec := json.NewDecoder(strings.NewReader(s))
		dec.UseNumber()
		var got any
		if err := dec.Decode(&got); err != nil {
			fail("not JSON: " + err.Error())
		}
		if want := jsonModel(v); !sameJSON(got, want) {
			t.Fatalf("field %q = %#v rendered %s, which decodes to %#v, want %#v", k, v, s, got, want)
		}
	default:
		t.Fatalf("generator made an unexpected %T", v)
	}
}

func sameFloat(a, b float64) bool {
	if math.IsNaN(a) || math.IsNaN(b) {
		return math.IsNaN(a) && math.IsNaN(b)
	}
	return a == b
}

func hasNonFinite(v any) bool {
	switch v := v.(type) {
	case float32:
		return math.IsNaN(float64(v)) || math.IsInf(float64(v), 0)
	case float64:
		return math.IsNaN(v) || math.IsInf(v, 0)
	case amqp.Table:
		for _, x := range v {
			if hasNonFinite(x) {
				return true
			}
		}
	case []any:
		for _, x := range v {
			if hasNonFinite(x) {
				return true
			}
		}
	}
	return false
}

// jsonModel is what a nested header value should decode to: text (bytes too)
// as a string, with invalid UTF-8 replaced byte by byte as JSON does;
// numbers as json.Number or float64 for floats; times as RFC 3339 text;
// decimals as their struct fields.
func jsonModel(v any) any {
	switch v := v.(type) {
	case string:
		return jsonText(v)
	case []byte:
		return jsonText(string(v))
	case bool, nil:
		return v
	case int8, int16, int32, int64, uint8, uint16, uint32:
		return json.Number(fmt.Sprint(v))
	case float32:
		return modelFloat32(v)
	case float64:
		return v
	case time.Time:
		return v.UTC().Format(time.RFC3339)
	case amqp.Decimal:
		return map[string]any{"Scale": json.Number(fmt.Sprint(v.Scale)), "Value": json.Number(fmt.Sprint(v.Value))}
	case amqp.Table:
		m := map[string]any{}
		for k, x := range v {
			m[jsonText(k)] = jsonModel(x)
		}
		return m
	case []any:
		a := make([]any, len(v))
		for i, x := range v {
			a[i] = jsonModel(x)
		}
		return a
	}
	panic(fmt.Sprintf("no model for %T", v))
}

// modelFloat32 marks a float32 in the model: JSON writes it in the shortest
// form that reads back as the same float32, not float64.
type modelFloat32 float32

// sameJSON compares a decoded document with the model; floats are compared
// by value, since JSON may write them in another form.
func sameJSON(got, want any) bool {
	switch w := want.(type) {
	case modelFloat32:
		n, ok := got.(json.Number)
		if !ok {
			return false
		}
		g, err := strconv.ParseFloat(string(n), 32)
		return err == nil && float32(g) == float32(w)
	case float64:
		n, ok := got.(json.Number)
		if !ok {
			return false
		}
		g, err := strconv.ParseFloat(string(n), 64)
		return err == nil && g == w
	case map[string]any:
		g, ok := got.(map[string]any)
		if !ok || len(g) != len(w) {
			return false
		}
		for k, x := range w {
			if !sameJSON(g[k], x) {
				return false
			}
		}
		return true
	case []any:
		g, ok := got.([]any)
		if !ok || len(g) != len(w) {
			return false
		}
		for i := range w {
			if !sameJSON(g[i], w[i]) {
				return false
			}
		}
		return true
	}
	return reflect.DeepEqual(got, want)
}

func jsonText(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n == 1 {
			b.WriteRune(utf8.RuneError)
		} else {
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

// fuzzIntHeader makes a header value of AMQP type kind%10 from n and s.
func fuzzIntHeader(kind uint8, n int64, s string) any {
	switch kind % 10 {
	case 0:
		return nil // absent
	case 1:
		return int8(n)
	case 2:
		return int16(n)
	case 3:
		return int32(n)
	case 4:
		return n
	case 5:
		return uint8(n)
	case 6:
		return uint16(n)
	case 7:
		return uint32(n)
	case 8:
		return s // a decimal string, or not
	default:
		return float64(n) // not an integer type: ignored
	}
}

// attemptModel is the reference reading of a delivery's attempt, in
// arbitrary precision: the base is custody-attempt when it is an integer
// above 1 (else 1); a quorum queue's x-delivery-count (integer, at least 0)
// adds to it; without one, a redelivery flag adds 1 where the Source counts
// deliveries. The result saturates at maxAttempt. A Source that does not
// count deliveries reports 0 for a message that carries neither count.
func attemptModel(attempt, count any, redelivered, counts bool) int64 {
	asInt := func(v any) (int64, bool) {
		switch v := v.(type) {
		case int8:
			return int64(v), true
		case int16:
			return int64(v), true
		case int32:
			return int64(v), true
		case int64:
			return v, true
		case uint8:
			return int64(v), true
		case uint16:
			return int64(v), true
		case uint32:
			return int64(v), true
		case string:
			n, err := strconv.ParseInt(v, 10, 64)
			return n, err == nil
		}
		return 0, false
	}
	base, copied := 1.0, false
	if n, ok := asInt(attempt); ok && n > 1 {
		base, copied = float64(n), true
	}
	sum := base
	if n, ok := asInt(count); ok && n >= 0 {
		sum += float64(n)
	} else if !counts && !copied {
		return 0
	} else if redelivered && counts {
		sum++
	}
	return int64(min(sum, float64(maxAttempt)))
}

// FuzzAttemptOf checks attemptOf against attemptModel: whatever a publisher
// puts in custody-attempt and whatever x-delivery-count says, the attempt is
// the model's, at most maxAttempt, and at least 1 where the Source counts
// deliveries.
func FuzzAttemptOf(f *testing.F) {
	f.Add(uint8(0), int64(0), "", uint8(0), int64(0), "", false)
	f.Add(uint8(4), int64(3), "", uint8(0), int64(0), "", true)
	f.Add(uint8(0), int64(0), "", uint8(4), int64(2), "", true)
	f.Add(uint8(8), int64(0), "7", uint8(8), int64(0), "-1", true)
	f.Add(uint8(4), int64(math.MaxInt64), "", uint8(4), int64(1), "", false)         // overflowed to a negative attempt
	f.Add(uint8(4), int64(math.MaxInt64-1), "", uint8(0), int64(0), "", true)        // overflowed to MinInt64
	f.Add(uint8(8), int64(0), "9223372036854775807", uint8(7), int64(-1), "", false) // uint32 max count
	f.Add(uint8(4), int64(1)<<32+1, "", uint8(0), int64(0), "", false)               // int truncation on 32-bit
	f.Add(uint8(9), int64(5), "", uint8(1), int64(-1), "", false)
	f.Fuzz(func(t *testing.T, aKind uint8, aN int64, aS string, cKind uint8, cN int64, cS string, redelivered bool) {
		// The flag's value chooses whether the Source counts deliveries too.
		counts := aN%2 == 0
		h := amqp.Table{}
		if v := fuzzIntHeader(aKind, aN, aS); v != nil {
			h[HeaderAttempt] = v
		}
		if v := fuzzIntHeader(cKind, cN, cS); v != nil {
			h["x-delivery-count"] = v
		}
		m := &amqp.Delivery{Headers: h, Redelivered: redelivered}
		got := attemptOf(m, counts)
		want := attemptModel(h[HeaderAttempt], h["x-delivery-count"], redelivered, counts)
		if int64(got) != want || got < 0 || (counts && got < 1) || got > maxAttempt {
			t.Fatalf("attemptOf(headers %#v, redelivered %v, counts %v) = %d, want %d", h, redelivered, counts, got, want)
		}
		// The attempt a retry republishes is the next one, and reads back.
		next := amqp.Table{HeaderAttempt: int64(max(got, 1) + 1)}
		if back := attemptOf(&amqp.Delivery{Headers: next}, counts); back != min(max(got, 1)+1, maxAttempt) {
			t.Fatalf("republished attempt %v reads back as %d, want %d", next[HeaderAttempt], back, min(max(got, 1)+1, maxAttempt))
		}
	})
}

// FuzzFirstReceived checks the custody-first-received header: any time
// republish writes (UTC, RFC 3339 with nanoseconds) reads back as the same
// instant, and any other value reads as the zero time or as what RFC 3339
// parsing makes of it, without panicking.
func FuzzFirstReceived(f *testing.F) {
	f.Add(int64(1_700_000_000), int64(123456789), "2023-11-14T22:13:20.123456789Z", false)
	f.Add(int64(0), int64(0), "", true)
	f.Add(int64(-62135596800), int64(0), "0000-01-01T00:00:00Z", false)
	f.Add(int64(253402300799), int64(999999999), "2023-11-14T22:13:20+01:00", false)
	f.Add(int64(1), int64(1), "not a time", true)
	f.Fuzz(func(t *testing.T, sec, nsec int64, s string, asBytes bool) {
		at := time.Unix(sec, nsec%1e9)
		if y := at.UTC().Year(); y >= 0 && y <= 9999 {
			h := amqp.Table{HeaderFirstReceived: at.UTC().Format(time.RFC3339Nano)}
			if got := firstReceivedOf(&amqp.Delivery{Headers: h}); !got.Equal(at) {
				t.Fatalf("first-received %v written as %q reads back as %v", at, h[HeaderFirstReceived], got)
			}
		}
		var v any = s
		if asBytes {
			v = []byte(s) // a foreign publisher's byte array: not ours, ignored
		}
		got := firstReceivedOf(&amqp.Delivery{Headers: amqp.Table{HeaderFirstReceived: v}})
		want, err := time.Parse(time.RFC3339Nano, s)
		if asBytes || err != nil {
			want = time.Time{}
		}
		if !got.Equal(want) || got.IsZero() != want.IsZero() {
			t.Fatalf("first-received %#v reads as %v, want %v", v, got, want)
		}
		if got := firstReceivedOf(&amqp.Delivery{}); !got.IsZero() {
			t.Fatalf("no header reads as %v", got)
		}
	})
}

// FuzzDelayStep checks delayStep against a reference (the smallest ladder step
// at or above the delay, else the last step) and the bounds the ladder
// promises: a delay is never cut short below the last step, and is rounded up
// by less than 2.5x above the first step, and by at most 2x above one second
// (1.7x above two seconds). Delay queue names read back to their step.
func FuzzDelayStep(f *testing.F) {
	for _, d := range []time.Duration{math.MinInt64, -1, 0, 1, 100 * time.Millisecond, 100*time.Millisecond + 1,
		time.Second, time.Second + 1, 2*time.Second + 1, 6 * time.Minute, 24 * time.Hour, 24*time.Hour + 1, math.MaxInt64} {
		f.Add(int64(d), "orders")
	}
	f.Add(int64(time.Minute), "")
	f.Add(int64(time.Minute), strings.Repeat("q", 240))
	f.Add(int64(time.Minute), strings.Repeat("é", 125))
	f.Fuzz(func(t *testing.T, n int64, queue string) {
		d := time.Duration(n)
		got := delayStep(d)
		want := delayLadder[len(delayLadder)-1]
		for _, s := range delayLadder {
			if d <= s {
				want = s
				break
			}
		}
		if got != want {
			t.Fatalf("delayStep(%v) = %v, want %v", d, got, want)
		}
		last := delayLadder[len(delayLadder)-1]
		switch {
		case d > last:
			if got != last {
				t.Fatalf("delayStep(%v) = %v, want the cap %v", d, got, last)
			}
		case got < d:
			t.Fatalf("delayStep(%v) = %v cuts the delay short", d, got)
		case d > 2*time.Second && float64(got) > 1.7*float64(d):
			t.Fatalf("delayStep(%v) = %v rounds up by more than 1.7x", d, got)
		case d > time.Second && got > 2*d:
			t.Fatalf("delayStep(%v) = %v rounds up by more than 2x", d, got)
		case d > delayLadder[0] && float64(got) >= 2.5*float64(d):
			t.Fatalf("delayStep(%v) = %v rounds up by 2.5x or more", d, got)
		}
		name := delayQueueName(queue, got)
		if len(name) > maxShortstr {
			t.Fatalf("delay queue name of %d bytes, over an AMQP short string", len(name))
		}
		if utf8.ValidString(queue) && !utf8.ValidString(name) {
			t.Fatalf("delay queue name %q of a UTF-8 queue name is not UTF-8", name)
		}
		// The queue's name, or as much of it as fits and a hash of it all.
		base, rest, ok := strings.Cut(name, delayQueueInfix)
		if i := strings.LastIndex(name, delayQueueInfix); ok {
			base, rest = name[:i], name[i+len(delayQueueInfix):]
		}
		if base != queue {
			prefix, hash, cut := strings.Cut(base[max(0, len(base)-17):], "~")
			if !cut || prefix != "" || len(hash) != 16 || !strings.HasPrefix(queue, base[:len(base)-17]) {
				t.Fatalf("delay queue name %q of a %d-byte queue name: want the name, or a prefix of it and ~hash", name, len(queue))
			}
			if len(queue)+len(delayQueueInfix)+len(rest) <= maxShortstr {
				t.Fatalf("delay queue name %q shortened though the whole name fits", name)
			}
		}
		ms, err := strconv.ParseInt(strings.TrimSuffix(rest, "ms"), 10, 64)
		if !ok || !strings.HasSuffix(rest, "ms") || err != nil || time.Duration(ms)*time.Millisecond != got {
			t.Fatalf("delay queue name %q does not read back to step %v", name, got)
		}
		if !bytes.Equal([]byte(delayQueueName(queue, got)), []byte(name)) {
			t.Fatalf("delay queue name is not stable")
		}
		if other := queue + "x"; len(name) == maxShortstr && delayQueueName(other, got) == name {
			t.Fatalf("queues %q and %q share the delay queue %q", queue, other, name)
		}
	})
}

// FuzzFitDeadLetter checks fitDeadLetter on random header tables and frame
// budgets: a copy that fits is left alone; otherwise the essential
// diagnostics always stay, the copy fits unless nothing else is left to
// leave out, the message's own headers go largest first, and the record
// names exactly what was left out, with its size.
func FuzzFitDeadLetter(f *testing.F) {
	f.Add([]byte{}, uint16(0))
	f.Add([]byte("\x06\x02ab\x00\x00\x00\x00\x00\x00\x00\x01\x00\x10xxxxxxxxxxxxxxxx\x01cd\x00\x00\x00\x00\x00\x00\x00\x01\x0f\x04"), uint16(3))
	f.Add([]byte("\x03\x01a\x00\x00\x00\x00\x00\x00\x00\x00\x10\x04\x01b\x00\x00\x00\x00\x00\x00\x00\x00\x0f\x05"), uint16(40))
	f.Fuzz(func(t *testing.T, data []byte, slack uint16) {
		r := &fieldReader{b: data}
		p := amqp.Publishing{Headers: r.table(0), MessageId: "id", DeliveryMode: amqp.Persistent}
		essentials := map[string]bool{}
		d := &adapters.Delivery{ID: "id", Queue: "q", Partition: 1, Offset: 2, Key: r.string(), PublishedAt: time.Unix(1, 0)}
		for k, v := range adapters.Diagnostics(d, adapters.Failure{Err: errors.New(r.string()), Attempts: 2, LastFailure: time.Unix(2, 0)}) {
			p.Headers[k] = v
			essentials[k] = !bulkyDiagnostics[k]
		}
		before := maps.Clone(p.Headers)
		size, err := headerFrameSize(&p)
		if err != nil {
			t.Fatal(err)
		}
		floor := contentHeaderFixed + 1 + len("id") + 1 + 4
		for k, ess := range essentials {
			if ess {
				e, _ := entrySize(k, p.Headers[k])
				floor += e
			}
		}
		budget := floor + int(slack%2048)
		fitDeadLetter(&p, budget, budget+frameOverhead)
		after, err := headerFrameSize(&p)
		if err != nil {
			t.Fatal(err)
		}
		rec, recorded := p.Headers[HeaderDroppedHeaders].(string)
		if size <= budget {
			if recorded || !maps.Equal(stringHeaders(p.Headers), stringHeaders(before)) {
				t.Fatalf("a copy of %d bytes that fits %d was changed", size, budget)
			}
			return
		}
		var r2 struct {
			Headers map[string]int `json:"headers"`
		}
		if !recorded || json.Unmarshal([]byte(rec), &r2) != nil {
			t.Fatalf("a copy of %d bytes over a budget of %d has no readable record: %q", size, budget, rec)
		}
		left := 0
		maxKept, minDropped := -1, math.MaxInt
		for k, v := range before {
			e, _ := entrySize(k, v)
			_, kept := p.Headers[k]
			n, named := r2.Headers[k]
			switch {
			case kept == named:
				t.Fatalf("header %q: kept %v, named in the record %v", k, kept, named)
			case named && n != e:
				t.Fatalf("header %q took %d bytes; the record says %d", k, e, n)
			case !kept && essentials[k]:
				t.Fatalf("essential diagnostic %q left out", k)
			}
			if !adapters.IsDiagnosticHeader(k) {
				if kept {
					left++
					maxKept = max(maxKept, e)
				} else {
					minDropped = min(minDropped, e)
				}
			}
		}
		if len(r2.Headers) == 0 {
			t.Fatal("the record names nothing")
		}
		if maxKept > minDropped {
			t.Fatalf("kept a header of %d bytes but left out one of %d", maxKept, minDropped)
		}
		if after > budget && left > 0 {
			t.Fatalf("the copy takes %d bytes of %d with %d headers of its own left to leave out", after, budget, left)
		}
	})
}
