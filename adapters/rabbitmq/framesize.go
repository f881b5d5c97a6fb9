package rabbitmq

import (
	"errors"
	"fmt"
	"maps"
	"sort"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
)

// An AMQP message's content header frame, which holds every property and
// the headers, is not split like the body: it must fit the connection's
// frame_max, and the broker closes the whole connection over a larger one
// (see the package documentation, section Copies must fit one frame).

const (
	// frameOverhead is what a frame adds to its payload: type (1 octet),
	// channel (2), payload size (4) and the frame-end octet.
	frameOverhead = 8
	// contentHeaderFixed is the fixed part of a content header payload:
	// class id (2), weight (2), body size (8) and property flags (2).
	contentHeaderFixed = 14
	// maxShortstr is the longest AMQP short string: property values such
	// as message-id, and every field-table key.
	maxShortstr = 255
)

// checkShortstr fails, for the caller named where, when s (what it names)
// is longer than an AMQP short string: the broker would refuse every use.
func checkShortstr(where, what, s string) error {
	if len(s) > maxShortstr {
		return fmt.Errorf("rabbitmq: %s: %s of %d bytes; AMQP allows at most %d", where, what, len(s), maxShortstr)
	}
	return nil
}

// errHeaderTooLarge is wrapped when a copy's content header frame would not
// fit the connection's frame_max: it is not published, since the broker
// would close the connection over it.
var errHeaderTooLarge = errors.New("rabbitmq: the message's properties and headers do not fit one AMQP frame")

// errShortstr is wrapped when a property or a header name (in any nested
// table too) is longer than an AMQP short string.
var errShortstr = errors.New("rabbitmq: longer than the 255 bytes of an AMQP short string")

// errFieldType is wrapped when a header value has a type AMQP cannot carry.
var errFieldType = errors.New("rabbitmq: header value of a type AMQP field tables cannot carry")

// headerFrameSize returns the size of the content header frame payload
// amqp091 writes for p.
func headerFrameSize(p *amqp.Publishing) (int, error) {
	n := contentHeaderFixed
	for _, s := range []string{p.ContentType, p.ContentEncoding, p.CorrelationId, p.ReplyTo, p.Expiration, p.MessageId, p.Type, p.UserId, p.AppId} {
		if len(s) > maxShortstr {
			return 0, fmt.Errorf("%w: a property of %d bytes", errShortstr, len(s))
		}
		if s != "" {
			n += 1 + len(s)
		}
	}
	if len(p.Headers) > 0 {
		t, err := tableSize(p.Headers)
		if err != nil {
			return 0, err
		}
		n += t
	}
	if p.DeliveryMode > 0 {
		n++
	}
	if p.Priority > 0 {
		n++
	}
	if !p.Timestamp.IsZero() {
		n += 8
	}
	return n, nil
}

// tableSize returns the encoded size of a field table: its 4-octet length
// and its entries.
func tableSize(t amqp.Table) (int, error) {
	n := 4
	for k, v := range t {
		e, err := entrySize(k, v)
		if err != nil {
			return 0, err
		}
		n += e
	}
	return n, nil
}

// entrySize returns the encoded size of one field-table entry: the key as a
// short string and the value as a typed field.
func entrySize(k string, v any) (int, error) {
	if len(k) > maxShortstr {
		return 0, fmt.Errorf("%w: a header name of %d bytes", errShortstr, len(k))
	}
	f, err := fieldSize(v)
	if err != nil {
		return 0, fmt.Errorf("header %q: %w", k, err)
	}
	return 1 + len(k) + f, nil
}

// fieldSize mirrors amqp091's writeField: a type octet and the value.
func fieldSize(v any) (int, error) {
	switch v := v.(type) {
	case bool, byte, int8:
		return 2, nil
	case int16, uint16:
		return 3, nil
	case int, int32, uint32, float32:
		return 5, nil
	case int64, float64, time.Time:
		return 9, nil
	case amqp.Decimal:
		return 6, nil
	case string:
		return 5 + len(v), nil
	case []byte:
		return 5 + len(v), nil
	case nil:
		return 1, nil
	case []any:
		n := 5
		for _, x := range v {
			f, err := fieldSize(x)
			if err != nil {
				return 0, err
			}
			n += f
		}
		return n, nil
	case amqp.Table:
		t, err := tableSize(v)
		return 1 + t, err
	}
	return 0, fmt.Errorf("%w: %T", errFieldType, v)
}

// additionsMargin covers header fields a broker version may add beyond
// those brokerAdditions counts.
const additionsMargin = 64

// brokerAdditions returns the most the broker adds to a message's headers
// before a consumer reads it, after it was published to exchange with
// routingKey and routed to queue ("": a queue the adapter cannot name,
// counted as the longest name): when it dead-letters it out of queue
// (x-death, x-first-death-*, from 3.13 x-last-death-*), and when a quorum
// queue redelivers it (x-delivery-count). A copy must leave that much room:
// past frame_max, the reader's client refuses the frame on every
// redelivery, and the queue stalls for good.
func brokerAdditions(queue, exchange, routingKey string) int {
	if queue == "" {
		queue = strings.Repeat("q", maxShortstr)
	}
	const reason = "delivery_limit" // the longest reason
	death := amqp.Table{"count": int64(0), "reason": reason, "queue": queue, "time": time.Time{},
		"exchange": exchange, "routing-keys": []any{routingKey}}
	n, _ := tableSize(amqp.Table{
		"x-death":                []any{death},
		"x-first-death-exchange": exchange, "x-first-death-queue": queue, "x-first-death-reason": reason,
		"x-last-death-exchange": exchange, "x-last-death-queue": queue, "x-last-death-reason": reason,
		"x-delivery-count": int64(0),
	})
	return n - 4 + additionsMargin
}

// bulkyDiagnostics are the diagnostic headers whose size comes from the
// message or the configuration (another broker's message key can be any
// size). The others (error, at most 1 KiB, attempts, failure times,
// partition, offset, timestamp) are small and always kept.
var bulkyDiagnostics = map[string]bool{
	adapters.HeaderOriginalKey: true, adapters.HeaderOriginalID: true, adapters.HeaderOriginalQueue: true,
	adapters.HeaderConsumer: true, adapters.HeaderOriginalExchange: true, adapters.HeaderOriginalRoutingKey: true,
}

// fitDeadLetter makes a dead-letter copy's content header fit budget by
// leaving out headers, largest first: the message's own, and the bulky
// diagnostics only when the copy would not fit even without those; it names
// them in HeaderDroppedHeaders. The body always fits, split across frames.
// A copy that still does not fit is refused by the publisher.
func fitDeadLetter(p *amqp.Publishing, budget, frameMax int) {
	size, err := headerFrameSize(p)
	if budget <= 0 || err != nil || size <= budget {
		return
	}
	dropped := map[string]int{}
	if old, ok := p.Headers[HeaderDroppedHeaders]; ok {
		// An earlier trip's record: those headers are gone for good.
		e, _ := entrySize(HeaderDroppedHeaders, old)
		size -= e
		delete(p.Headers, HeaderDroppedHeaders)
		if !mergeDropped(dropped, old) {
			dropped[HeaderDroppedHeaders] = e
		}
	}
	type entry struct {
		name string
		size int
	}
	var own, bulky []entry
	for k, v := range p.Headers {
		e, err := entrySize(k, v)
		if err != nil {
			continue
		}
		switch {
		case bulkyDiagnostics[k]:
			bulky = append(bulky, entry{k, e})
		case !adapters.IsDiagnosticHeader(k):
			own = append(own, entry{k, e})
		}
	}
	for _, es := range [][]entry{own, bulky} {
		sort.Slice(es, func(i, j int) bool {
			if es[i].size != es[j].size {
				return es[i].size > es[j].size
			}
			return es[i].name < es[j].name
		})
	}
	reason := fmt.Sprintf("the copy's AMQP content header must fit the connection's frame_max (%d bytes), with room for the headers the broker adds", frameMax)
	// fits reports whether the copy fits, its record of what was left out
	// included, once the headers in also are left out too.
	fits := func(also []entry) bool {
		n, names := size, dropped
		if len(also) > 0 {
			names = maps.Clone(dropped)
			for _, e := range also {
				n -= e.size
				names[e.name] = e.size
			}
		}
		if len(names) > 0 {
			e, _ := entrySize(HeaderDroppedHeaders, droppedRecord(reason, names))
			n += e
		}
		return n <= budget
	}
	drop := func(e entry) {
		delete(p.Headers, e.name)
		size -= e.size
		dropped[e.name] = e.size
	}
	// A diagnostic goes only if the copy would not fit even without any
	// header of the message's own (another broker's message key can be
	// larger than a frame by itself); then the message's own headers go,
	// largest first, until the copy fits.
	for _, e := range bulky {
		if fits(own) {
			break
		}
		drop(e)
	}
	for _, e := range own {
		if fits(nil) {
			break
		}
		drop(e)
	}
	if len(dropped) > 0 {
		p.Headers[HeaderDroppedHeaders] = droppedRecord(reason, dropped)
	}
}

// droppedHeaders is the value of HeaderDroppedHeaders.
type droppedHeaders struct {
	Reason  string         `json:"reason"`
	Headers map[string]int `json:"headers"`
}

// droppedRecord renders HeaderDroppedHeaders' value, names sorted.
func droppedRecord(reason string, dropped map[string]int) string {
	return jsonEncode(droppedHeaders{reason, dropped})
}

// mergeDropped adds the headers an earlier HeaderDroppedHeaders record
// names to dropped, and reports whether old was such a record.
func mergeDropped(dropped map[string]int, old any) bool {
	var rec droppedHeaders
	if !decodeJSONHeader(old, &rec) || rec.Headers == nil {
		return false
	}
	maps.Copy(dropped, rec.Headers)
	return true
}

// fitRetry makes a retry's copy fit budget by leaving out what only feeds
// dead-letter diagnostics: HeaderFirstReceived, then the original exchange
// and routing key. The message's own headers and HeaderAttempt stay: a copy
// that still does not fit is refused, and the original requeued. It returns
// the headers it left out.
func fitRetry(p *amqp.Publishing, budget int) []string {
	size, err := headerFrameSize(p)
	if budget <= 0 || err != nil || size <= budget {
		return nil
	}
	var shed []string
	for _, group := range [][]string{{HeaderFirstReceived}, {HeaderOriginalExchange, HeaderOriginalRoutingKey}} {
		for _, k := range group {
			v, ok := p.Headers[k]
			if !ok {
				continue
			}
			e, _ := entrySize(k, v)
			delete(p.Headers, k)
			size -= e
			shed = append(shed, k)
		}
		if size <= budget {
			break
		}
	}
	return shed
}
