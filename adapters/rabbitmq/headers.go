package rabbitmq

import (
	"encoding/json"
	"fmt"
	"math"
	"strconv"
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
)

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
// whether it was redelivered at all, which counts as one more attempt: a
// lower bound.
//
// Any publisher can set HeaderAttempt, so the sum saturates at maxAttempt:
// an overflow would otherwise wrap to a negative attempt, which the runtime
// reads as a first attempt.
func attemptOf(m *amqp.Delivery) int {
	base := int64(1)
	if n, ok := headerInt(m.Headers, HeaderAttempt); ok && n > 1 {
		base = min(n, maxAttempt)
	}
	if n, ok := headerInt(m.Headers, "x-delivery-count"); ok && n >= 0 {
		return int(min(base+min(n, maxAttempt), maxAttempt))
	}
	if m.Redelivered {
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

// republishing copies a delivery into a new publishing: same body and
// properties, broker-set headers removed, routing headers set aside, the
// original route remembered.
func republishing(m *amqp.Delivery) amqp.Publishing {
	h := amqp.Table{}
	for k, v := range m.Headers {
		h[k] = v
	}
	for _, k := range brokerHeaders {
		delete(h, k)
	}
	setRoutingHeadersAside(h)
	if _, ok := h[HeaderOriginalExchange]; !ok {
		h[HeaderOriginalExchange] = m.Exchange
		h[HeaderOriginalRoutingKey] = m.RoutingKey
	}
	if m.Expiration != "" {
		// A per-message TTL would cut a delay short or silently drop the
		// copy from a dead-letter queue; keep it only as information.
		h[HeaderOriginalExpiration] = m.Expiration
	}
	return amqp.Publishing{
		Headers:         h,
		ContentType:     m.ContentType,
		ContentEncoding: m.ContentEncoding,
		DeliveryMode:    m.DeliveryMode,
		Priority:        m.Priority,
		CorrelationId:   m.CorrelationId,
		ReplyTo:         m.ReplyTo,
		MessageId:       m.MessageId,
		Timestamp:       m.Timestamp,
		Type:            m.Type,
		UserId:          m.UserId,
		AppId:           m.AppId,
		Body:            m.Body,
	}
}

// originalRoute returns where the message was first published.
func originalRoute(m *amqp.Delivery) (exchange, routingKey string) {
	if e, ok := m.Headers[HeaderOriginalExchange].(string); ok {
		k, _ := m.Headers[HeaderOriginalRoutingKey].(string)
		return e, k
	}
	return m.Exchange, m.RoutingKey
}
