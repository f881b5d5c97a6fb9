package rabbitmq

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/custody-go/custody/adapters"
	amqp "github.com/rabbitmq/amqp091-go"
)

// Header names this adapter reads and writes besides the shared diagnostic
// vocabulary of package adapters.
const (
	// HeaderAttempt carries, on a message republished for a retry, the
	// attempt number its next delivery starts at (2 for the first retry).
	HeaderAttempt = "custody-attempt"
	// HeaderFirstReceived carries, on a republished retry, when the message
	// was first received (RFC 3339), so dead-letter diagnostics can say when
	// its first failure happened even in another process.
	HeaderFirstReceived = "custody-first-received"
	// HeaderOriginalExchange and HeaderOriginalRoutingKey name where the
	// message was first published. Retries republish through the default
	// exchange, so these keep the original route for dead-letter diagnostics.
	HeaderOriginalExchange   = adapters.HeaderOriginalExchange
	HeaderOriginalRoutingKey = adapters.HeaderOriginalRoutingKey
	// HeaderOriginalExpiration keeps a per-message TTL that a republished
	// copy drops.
	HeaderOriginalExpiration = "custody-original-expiration"
	// HeaderOriginalUserID keeps a user-id property that a copy cannot
	// carry: RabbitMQ refuses a publish whose user-id is not the publishing
	// connection's user.
	HeaderOriginalUserID = "custody-original-user-id"
	// HeaderOriginalCC and HeaderOriginalBCC keep the sender-selected
	// distribution headers (CC, BCC) that a copy must not carry: the broker
	// would route it to those queues again.
	HeaderOriginalCC  = "custody-original-cc"
	HeaderOriginalBCC = "custody-original-bcc"
	// HeaderOriginalHeaders keeps, on a dead-letter copy of another
	// adapter's delivery, the headers AMQP cannot carry under their own
	// name: names longer than 255 bytes (a field-table key is a short
	// string). Its value is a JSON object from name to value; invalid UTF-8
	// in a name or value becomes U+FFFD there. A copy that already carries
	// one (from an earlier trip) has it merged into the new one.
	HeaderOriginalHeaders = "custody-original-headers"
	// HeaderOriginalXDeath keeps, on a dead-letter copy, an x-death header
	// the broker must not see under that name: another adapter's (text, as
	// every foreign header is), or one not of the broker's shape (an array
	// of tables whose counts are numbers), which makes RabbitMQ crash the
	// queue that dead-letters the message. Other headers named like the
	// broker's own on another adapter's delivery (x-delivery-count,
	// x-first-death-*, x-last-death-*) are kept the same way, as
	// custody-original-<name>.
	HeaderOriginalXDeath = "custody-original-x-death"
	// HeaderDroppedHeaders names, on a dead-letter copy, the headers left out
	// because the copy's content header frame would not have fitted the
	// connection's frame_max, with room kept for the headers the broker
	// adds. Its value is JSON: the reason, and for each dropped header the
	// bytes its name and value took in the frame, for example
	//
	//	{"reason":"the copy's AMQP content header must fit the connection's frame_max (131072 bytes), with room for the headers the broker adds","headers":{"large":153611}}
	//
	// A record from an earlier dead-letter trip is merged into the new one.
	HeaderDroppedHeaders = "custody-dropped-headers"
)

// originalPrefix names what a copy sets aside: a header the copy must not
// carry under its own name k travels as originalPrefix+k.
const originalPrefix = "custody-original-"

// brokerHeaders are headers the broker sets on delivery. A republished copy
// must not carry them: a stale x-delivery-count would inflate the attempt
// count, and a stale x-death can make the broker see a dead-letter cycle and
// drop the message.
var brokerHeaders = []string{"x-delivery-count", "x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason", "x-last-death-exchange", "x-last-death-queue", "x-last-death-reason"}

// routingHeaders are headers the broker acts on when a message is published,
// with the names a copy keeps them under instead: CC and BCC route the
// message to more queues (sender-selected distribution), and must be arrays.
// A retry's copy or a dead letter carrying them would land in those queues
// once more, and a text CC header (from another broker's message) would make
// the broker refuse the publish every time.
var routingHeaders = map[string]string{"CC": HeaderOriginalCC, "BCC": HeaderOriginalBCC}

// setRoutingHeadersAside moves the routing headers of h to their custody
// names.
func setRoutingHeadersAside(h amqp.Table) {
	for k, aside := range routingHeaders {
		if v, ok := h[k]; ok {
			delete(h, k)
			h[aside] = v
		}
	}
}

// setBrokerHeadersAside moves the broker's own header names (x-death,
// x-delivery-count, x-first-death-*, x-last-death-*) of another adapter's
// delivery to custody-original-<name>. Such a header came from elsewhere (a
// message bridged from RabbitMQ, or a look-alike): under its own name it
// would be taken for this broker's history. A stale x-delivery-count would
// inflate the attempt count of a copy replayed from the dead-letter queue;
// an x-first-death-* header stops the broker from writing its own; and the
// broker silently replaces an x-death that is not its own array of tables
// when it dead-letters the copy, so the foreign value would be lost.
func setBrokerHeadersAside(h amqp.Table) {
	for _, k := range brokerHeaders {
		if v, ok := h[k]; ok {
			delete(h, k)
			h[originalPrefix+k] = v
		}
	}
}

// isXDeath reports whether v has the shape of the broker's x-death header:
// an array of tables, each count (if any) an integer. When RabbitMQ (3.10)
// dead-letters a message whose x-death has another shape, its dead-lettering
// code crashes the queue (function_clause on an array entry that is not a
// table, a failed increment on an entry for this queue and reason whose
// count is text): the message is lost, and the queue may not restart. A copy
// keeps any other x-death only aside, under HeaderOriginalXDeath, where the
// broker does not read it.
func isXDeath(v any) bool {
	a, ok := v.([]any)
	if !ok {
		return false
	}
	for _, x := range a {
		t, ok := x.(amqp.Table)
		if !ok {
			return false
		}
		if c, ok := t["count"]; ok {
			switch c.(type) {
			case int8, int16, int32, int64, int, uint8, uint16, uint32:
			default:
				return false
			}
		}
	}
	return true
}

// dropDiagnostics removes the shared diagnostic headers (an earlier
// dead-letter trip's, on a message replayed from a dead-letter queue), so
// that a new dead-letter copy describes its latest failure only.
func dropDiagnostics(h amqp.Table) {
	for k := range h {
		if adapters.IsDiagnosticHeader(k) {
			delete(h, k)
		}
	}
}

// foreignHeaders turns another adapter's string headers into an AMQP table
// for a dead-letter copy: names AMQP cannot carry go into
// HeaderOriginalHeaders, routing and broker headers are set aside, and an
// earlier trip's diagnostics are dropped.
func foreignHeaders(in map[string]string) amqp.Table {
	h := make(amqp.Table, len(in)+16)
	var long map[string]string
	for k, v := range in {
		if len(k) > maxShortstr {
			if long == nil {
				long = map[string]string{}
			}
			long[k] = v
			continue
		}
		h[k] = v
	}
	if long != nil {
		all := map[string]string{}
		if !decodeJSONHeader(h[HeaderOriginalHeaders], &all) {
			if old, ok := h[HeaderOriginalHeaders].(string); ok {
				all[HeaderOriginalHeaders] = old // not ours: keep it inside
			}
		}
		for k, v := range long {
			all[k] = v
		}
		h[HeaderOriginalHeaders] = jsonEncode(all)
	}
	setRoutingHeadersAside(h)
	setBrokerHeadersAside(h)
	dropDiagnostics(h)
	return h
}

// jsonEncode renders a string, or a map of strings (keys sorted), as JSON
// without HTML escaping; either always encodes.
func jsonEncode(v any) string {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v)
	return strings.TrimSuffix(b.String(), "\n")
}

// decodeJSONHeader decodes a text header holding JSON into out, and reports
// whether it could.
func decodeJSONHeader(v any, out any) bool {
	var b []byte
	switch v := v.(type) {
	case string:
		b = []byte(v)
	case []byte:
		b = v
	default:
		return false
	}
	return json.Unmarshal(b, out) == nil
}

// stringHeaders renders AMQP header values as strings: text as is, numbers in
// decimal, times in RFC 3339, nested tables and arrays (x-death) as JSON.
func stringHeaders(t amqp.Table) map[string]string {
	if len(t) == 0 {
		return nil
	}
	h := make(map[string]string, len(t))
	for k, v := range t {
		h[k] = headerString(v)
	}
	return h
}

func headerString(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case []byte:
		return string(v)
	case bool:
		return strconv.FormatBool(v)
	case int8, int16, int32, int64, int, uint8, uint16, uint32, uint64:
		return fmt.Sprint(v)
	case float32:
		return strconv.FormatFloat(float64(v), 'g', -1, 32)
	case float64:
		return strconv.FormatFloat(v, 'g', -1, 64)
	case time.Time:
		return v.UTC().Format(time.RFC3339)
	case amqp.Decimal:
		return fmt.Sprintf("%de-%d", v.Value, v.Scale)
	case nil:
		return ""
	default:
		b, err := json.Marshal(jsonable(v))
		if err != nil {
			return fmt.Sprint(v)
		}
		return string(b)
	}
}

// jsonable turns AMQP tables and arrays into values encoding/json renders
// readably ([]byte as text rather than base64).
func jsonable(v any) any {
	switch v := v.(type) {
	case amqp.Table:
		m := make(map[string]any, len(v))
		for k, x := range v {
			m[k] = jsonable(x)
		}
		return m
	case []any:
		a := make([]any, len(v))
		for i, x := range v {
			a[i] = jsonable(x)
		}
		return a
	case []byte:
		return string(v)
	case time.Time:
		return v.UTC().Format(time.RFC3339)
	default:
		return v
	}
}

// headerInt reads an integer header of any AMQP integer type, or a decimal
// string.
func headerInt(t amqp.Table, k string) (int64, bool) {
	switch v := t[k].(type) {
	case int8:
		return int64(v), true
	case int16:
		return int64(v), true
	case int32:
		return int64(v), true
	case int64:
		return v, true
	case int:
		return int64(v), true
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

// attemptOf computes which attempt a delivery is. The base is the attempt a
// republished retry starts at (HeaderAttempt, else 1). Quorum queues count
// the redeliveries of this copy in x-delivery-count; classic queues only say
// whether it was redelivered at all. Where the Source counts deliveries
// (counts: a quorum queue, or retries through delay queues) a redelivery
// counts as one more attempt, a lower bound; where it does not, a message
// that carries no count is attempt 0, unknown, and the runtime counts the
// attempts it makes.
//
// Any publisher can set HeaderAttempt, so the sum saturates at maxAttempt:
// an overflow would otherwise wrap to a negative attempt, which the runtime
// reads as a first attempt.
func attemptOf(m *amqp.Delivery, counts bool) int {
	base, copied := int64(1), false
	if n, ok := headerInt(m.Headers, HeaderAttempt); ok && n > 1 {
		base, copied = min(n, maxAttempt), true
	}
	switch n, ok := headerInt(m.Headers, "x-delivery-count"); {
	case ok && n >= 0:
		return int(min(base+min(n, maxAttempt), maxAttempt))
	case !counts && !copied:
		return 0
	case counts && m.Redelivered:
		return int(min(base+1, maxAttempt))
	}
	return int(base)
}

// maxAttempt caps the attempt a delivery reports; it fits an int everywhere.
const maxAttempt = math.MaxInt32

// firstReceivedOf reads HeaderFirstReceived.
func firstReceivedOf(m *amqp.Delivery) time.Time {
	s, _ := m.Headers[HeaderFirstReceived].(string)
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return time.Time{}
	}
	return t
}

// copyOf returns a publishing with m's body, properties and headers, less
// the headers the broker sets (brokerHeaders).
func copyOf(m *amqp.Delivery) amqp.Publishing {
	h := make(amqp.Table, len(m.Headers)+4)
	for k, v := range m.Headers {
		h[k] = v
	}
	for _, k := range brokerHeaders {
		delete(h, k)
	}
	return amqp.Publishing{
		Headers:         h,
		ContentType:     m.ContentType,
		ContentEncoding: m.ContentEncoding,
		DeliveryMode:    m.DeliveryMode,
		Priority:        m.Priority,
		CorrelationId:   m.CorrelationId,
		ReplyTo:         m.ReplyTo,
		Expiration:      m.Expiration,
		MessageId:       m.MessageId,
		Timestamp:       m.Timestamp,
		Type:            m.Type,
		UserId:          m.UserId,
		AppId:           m.AppId,
		Body:            m.Body,
	}
}

// republishing copies a delivery for a retry or a dead letter: routing
// headers and a per-message TTL set aside, the original route remembered.
func republishing(m *amqp.Delivery) amqp.Publishing {
	p := copyOf(m)
	setRoutingHeadersAside(p.Headers)
	if _, ok := p.Headers[HeaderOriginalExchange]; !ok {
		p.Headers[HeaderOriginalExchange] = m.Exchange
		p.Headers[HeaderOriginalRoutingKey] = m.RoutingKey
	}
	if p.Expiration != "" {
		// A per-message TTL would cut a delay short or silently drop the
		// copy from a dead-letter queue; keep it only as information.
		p.Headers[HeaderOriginalExpiration] = p.Expiration
		p.Expiration = ""
	}
	return p
}

// originalRoute returns where the message was first published.
func originalRoute(m *amqp.Delivery) (exchange, routingKey string) {
	if e, ok := m.Headers[HeaderOriginalExchange].(string); ok {
		k, _ := m.Headers[HeaderOriginalRoutingKey].(string)
		return e, k
	}
	return m.Exchange, m.RoutingKey
}
