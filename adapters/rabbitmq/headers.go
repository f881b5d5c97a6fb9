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
	// adapter's delivery, the headers whose names are longer than an AMQP
	// field-table key (255 bytes): a JSON object from name to value, invalid
	// UTF-8 replaced by U+FFFD. An earlier trip's is merged into it.
	HeaderOriginalHeaders = "custody-original-headers"
	// HeaderOriginalXDeath keeps, on a dead-letter copy, an x-death the
	// broker must not see under that name: another adapter's, or one not of
	// the broker's shape (see isXDeath). Another adapter's x-delivery-count,
	// x-first-death-* and x-last-death-* are kept as custody-original-<name>.
	HeaderOriginalXDeath = "custody-original-x-death"
	// HeaderDroppedHeaders names, on a dead-letter copy, the headers left out
	// to fit the connection's frame_max, as JSON: the reason, and the bytes
	// each header's name and value took, for example
	//
	//	{"reason":"the copy's AMQP content header must fit the connection's frame_max (131072 bytes), with room for the headers the broker adds","headers":{"large":153611}}
	//
	// An earlier trip's record is merged into it.
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

// routingHeaders are the headers the broker routes a published message by
// (CC and BCC, sender-selected distribution, which must be arrays), with the
// names a copy keeps them under: under their own, a copy would land in those
// queues once more, and a text CC (another broker's) would be refused.
var routingHeaders = map[string]string{"CC": HeaderOriginalCC, "BCC": HeaderOriginalBCC}

// setRoutingHeadersAside moves h's routing headers to their custody names.
func setRoutingHeadersAside(h amqp.Table) {
	for k, aside := range routingHeaders {
		if v, ok := h[k]; ok {
			delete(h, k)
			h[aside] = v
		}
	}
}

// setBrokerHeadersAside moves another adapter's headers named like the
// broker's own (brokerHeaders) to custody-original-<name>: under their own
// name a stale x-delivery-count would inflate the attempts of a copy
// replayed from the dead-letter queue, an x-first-death-* header would stop
// the broker writing its own, and the broker replaces an x-death that is not
// its own array of tables when it dead-letters the copy.
func setBrokerHeadersAside(h amqp.Table) {
	for _, k := range brokerHeaders {
		if v, ok := h[k]; ok {
			delete(h, k)
			h[originalPrefix+k] = v
		}
	}
}

// isXDeath reports whether v has the shape of the broker's x-death header:
// an array of tables, each count (if any) an integer. RabbitMQ (3.10)
// crashes the queue that dead-letters a message whose x-death has another
// shape (function_clause on an entry that is not a table, a failed increment
// of a text count): the message is lost, and the queue may not restart.
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

// dropDiagnostics removes the shared diagnostic headers an earlier
// dead-letter trip left, so that a new copy describes its latest failure.
func dropDiagnostics(h amqp.Table) {
	for k := range h {
		if adapters.IsDiagnosticHeader(k) {
			delete(h, k)
		}
	}
}

// foreignHeaders turns another adapter's string headers into an AMQP table
// for a dead-letter copy (see the package documentation, section Dead
// letters).
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

// jsonEncode renders v, which always encodes, as JSON without HTML escaping
// (map keys sorted).
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

// attemptOf computes which attempt a delivery is, from HeaderAttempt (else
// 1) and x-delivery-count or the redelivered flag (see the package
// documentation, section Attempts); 0 where the Source does not count
// deliveries and the message carries no count. Any publisher can set
// HeaderAttempt, so the sum saturates at maxAttempt: an overflow would wrap
// to a negative attempt, which the runtime reads as a first attempt.
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
