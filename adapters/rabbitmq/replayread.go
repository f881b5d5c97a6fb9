package rabbitmq

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"hash"
	"slices"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
)

// deadLetter is one message read from a dead-letter queue: the record
// List shows, and what a replay needs besides.
type deadLetter struct {
	rec adapters.DeadLetterRecord
	msg *amqp.Delivery
	// exchange and key are the route the message was first published
	// with, when routed says the dead letter records one.
	exchange, key string
	routed        bool
}

// readDeadLetter reads a message of a dead-letter queue: a DeadLetter
// sink's copy carries the custody diagnostics; one the broker dead-lettered
// carries x-death and x-first-death-*, from which the original queue, the
// reason (as the error) and the time of its latest death are read. The
// broker's headers go to the record's Diagnostics, never to its Headers;
// x-delivery-count, which a quorum dead-letter queue adds on each
// redelivery, is left out of both.
func readDeadLetter(m *amqp.Delivery) deadLetter {
	dl := deadLetter{msg: m}
	rec := &dl.rec
	rec.ID = deadLetterID(m)
	rec.Body = m.Body
	h := stringHeaders(m.Headers)
	delete(h, "x-delivery-count")
	custody := adapters.ReadDeadLetter(rec, h)
	for _, k := range brokerHeaders {
		if v, ok := rec.Headers[k]; ok {
			delete(rec.Headers, k)
			rec.Diagnostics[k] = v
		}
	}
	if rec.OriginalID == "" {
		rec.OriginalID = m.MessageId
	}
	if custody {
		ex, okEx := rec.Diagnostics[adapters.HeaderOriginalExchange]
		key, okKey := rec.Diagnostics[adapters.HeaderOriginalRoutingKey]
		dl.exchange, dl.key, dl.routed = ex, key, okEx && okKey
		return dl
	}
	// A dead letter the broker made.
	queue, _ := m.Headers["x-first-death-queue"].(string)
	reason, _ := m.Headers["x-first-death-reason"].(string)
	rec.OriginalQueue, rec.Error = queue, reason
	deaths, _ := m.Headers["x-death"].([]any)
	for i, d := range deaths {
		t, ok := d.(amqp.Table)
		if !ok {
			continue
		}
		if i == 0 {
			// The latest death comes first.
			rec.LastFailure, _ = t["time"].(time.Time)
		}
		if q, _ := t["queue"].(string); q != queue || t["reason"] != reason {
			continue
		}
		// The first death's entry: where the message was published.
		if keys, _ := t["routing-keys"].([]any); len(keys) > 0 {
			ex, okEx := t["exchange"].(string)
			key, okKey := keys[0].(string)
			dl.exchange, dl.key, dl.routed = ex, key, okEx && okKey
		}
	}
	if rec.FirstFailure.IsZero() {
		rec.FirstFailure = rec.LastFailure
	}
	return dl
}

// deadLetterID digests m's properties, headers (less x-delivery-count,
// which changes with each redelivery) and body (see Replay).
func deadLetterID(m *amqp.Delivery) string {
	d := sha256.New()
	for _, p := range []string{m.ContentType, m.ContentEncoding, strconv.Itoa(int(m.DeliveryMode)),
		strconv.Itoa(int(m.Priority)), m.CorrelationId, m.ReplyTo, m.Expiration, m.MessageId,
		m.Timestamp.UTC().Format(time.RFC3339), m.Type, m.UserId, m.AppId} {
		field(d, p)
	}
	h := stringHeaders(m.Headers)
	keys := make([]string, 0, len(h))
	for k := range h {
		if k != "x-delivery-count" {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		field(d, k)
		field(d, h[k])
	}
	field(d, string(m.Body))
	return hex.EncodeToString(d.Sum(nil)[:16])
}

// field writes s to d with its length first, so that no two sequences of
// fields write the same bytes.
func field(d hash.Hash, s string) {
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(s)))
	d.Write(n[:])
	d.Write([]byte(s))
}
