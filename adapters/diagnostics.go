package adapters

import (
	"strconv"
	"time"
	"unicode/utf8"
)

// Header names dead-letter destinations use for diagnostics. Every adapter's
// DeadLetter writes the same names (packed into one attribute where the broker
// limits their number), so operators and tools read one vocabulary.
const (
	HeaderError          = "custody-error"
	HeaderPermanent      = "custody-permanent"
	HeaderAttempts       = "custody-attempts"
	HeaderFirstFailure   = "custody-first-failure"
	HeaderLastFailure    = "custody-last-failure"
	HeaderOriginalQueue  = "custody-original-queue"
	HeaderOriginalID     = "custody-original-id"
	HeaderOriginalPart   = "custody-original-partition"
	HeaderOriginalOffset = "custody-original-offset"
	HeaderOriginalTime   = "custody-original-timestamp"
	HeaderOriginalKey    = "custody-original-key"
	HeaderConsumer       = "custody-consumer"
	// HeaderOriginalExchange and HeaderOriginalRoutingKey are written by
	// AMQP dead-letter destinations.
	HeaderOriginalExchange   = "custody-original-exchange"
	HeaderOriginalRoutingKey = "custody-original-routing-key"
	diagnosticTimeLayout     = time.RFC3339Nano
	maxDiagnosticErrorSize   = 1024
)

// Diagnostics returns the dead-letter diagnostic headers for d failing with f.
// Times are RFC 3339 in UTC; the error text is cut to at most 1 KiB, on a
// character boundary. The error header is present whenever f has an error,
// even one with empty text; other empty or not-applicable values are left
// out.
func Diagnostics(d *Delivery, f Failure) map[string]string {
	h := make(map[string]string, 12)
	if f.Err != nil {
		msg := f.Err.Error()
		if len(msg) > maxDiagnosticErrorSize {
			// Cut before a character that would straddle the limit, so
			// the header stays valid UTF-8 for brokers that check.
			cut := maxDiagnosticErrorSize
			for i := 0; i < utf8.UTFMax-1 && !utf8.RuneStart(msg[cut]); i++ {
				cut--
			}
			msg = msg[:cut]
		}
		h[HeaderError] = msg
	}
	h[HeaderPermanent] = strconv.FormatBool(f.Permanent)
	h[HeaderAttempts] = strconv.Itoa(f.Attempts)
	putTime(h, HeaderFirstFailure, f.FirstFailure)
	putTime(h, HeaderLastFailure, f.LastFailure)
	if d.Queue != "" {
		h[HeaderOriginalQueue] = d.Queue
	}
	if d.ID != "" {
		h[HeaderOriginalID] = d.ID
	}
	if d.Partition >= 0 && d.Offset >= 0 {
		h[HeaderOriginalPart] = strconv.FormatInt(int64(d.Partition), 10)
		h[HeaderOriginalOffset] = strconv.FormatInt(d.Offset, 10)
	}
	putTime(h, HeaderOriginalTime, d.PublishedAt)
	if d.Key != "" {
		h[HeaderOriginalKey] = d.Key
	}
	if f.Consumer != "" {
		h[HeaderConsumer] = f.Consumer
	}
	return h
}

// IsDiagnosticHeader reports whether name is one of the diagnostic headers
// above, or a replay's (HeaderReplayOf, HeaderReplayDiagnostics). A
// dead-letter destination drops them from the message it copies before it
// writes its own: a message that was dead-lettered, replayed and
// dead-lettered again must describe its latest failure, not a mix of the
// two (the old copy's partition beside the new copy's queue, say).
func IsDiagnosticHeader(name string) bool {
	switch name {
	case HeaderError, HeaderPermanent, HeaderAttempts, HeaderFirstFailure, HeaderLastFailure,
		HeaderOriginalQueue, HeaderOriginalID, HeaderOriginalPart, HeaderOriginalOffset,
		HeaderOriginalTime, HeaderOriginalKey, HeaderConsumer,
		HeaderOriginalExchange, HeaderOriginalRoutingKey,
		HeaderReplayOf, HeaderReplayDiagnostics:
		return true
	}
	return false
}

func putTime(h map[string]string, k string, t time.Time) {
	if !t.IsZero() {
		h[k] = t.UTC().Format(diagnosticTimeLayout)
	}
}
