package jetstream

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/option"
)

// Header names the DeadLetter adds beside package adapters'
// diagnostic headers.
const (
	// HeaderOriginalSubject is the subject the original message was
	// published on.
	HeaderOriginalSubject = "custody-original-subject"
	// HeaderOriginalHeaders holds, as one JSON object of name to value, the
	// original's headers that cannot travel as NATS headers as they are:
	// names that are empty or hold a colon, white space or control
	// characters; values with line breaks or leading white space (NATS
	// would cut or trim them); and the server's own Nats-* headers, which
	// the server would act on in the dead-letter stream (deduplicate,
	// expect a sequence, roll up).
	HeaderOriginalHeaders = "custody-original-headers"
	// HeaderDroppedHeaders lists, as a JSON array, the names of the
	// original's headers left out of the copy because JetStream refuses a
	// message whose headers exceed 64 KiB: the largest go first.
	HeaderDroppedHeaders = "custody-dropped-headers"
	// headerBudget is how large the copy's original headers may be, leaving
	// room under the server's 64 KiB for the diagnostics and Nats-Msg-Id.
	headerBudget = 56 << 10
)

// DeadLetter is an adapters.DeadLetter that publishes failed messages to a
// subject a JetStream stream captures. The copy has the original's body and
// headers and the diagnostic headers (package adapters' Header* names:
// custody-error, custody-attempts, custody-first-failure, ...; line breaks in
// the error text written as \r and \n), plus custody-original-subject;
// headers that cannot travel as they are go into custody-original-headers
// (see [HeaderOriginalHeaders]). Send returns nil only once the stream
// confirmed the copy (a PubAck); a failed publish leaves the original with
// the runtime, which keeps it and tries again later.
//
// For a delivery of a [Source], Send then terminates the original (+TERM,
// awaiting the server's reply) and SettlesOriginal reports it, so the
// runtime does not ack it; if the term fails, the runtime acks it instead.
// A delivery from another broker is only copied.
//
// Each copy carries a Nats-Msg-Id derived from the delivery, so a Send
// repeated after a lost PubAck is stored once within the stream's duplicate
// window. A message dead-lettered before and replayed gets fresh
// diagnostics: the earlier trip's diagnostic headers are dropped, and what
// custody-original-headers held of the message itself is kept.
type DeadLetter struct {
	js      jetstream.JetStream
	subject string
	stream  string
}

var (
	_ adapters.DeadLetter      = (*DeadLetter)(nil)
	_ adapters.OriginalSettler = (*DeadLetter)(nil)
)

// DeadLetterOption configures a [DeadLetter].
type DeadLetterOption func(*deadLetterOptions) error

type deadLetterOptions struct {
	create *jetstream.StreamConfig // nil: a stream must capture the subject
}

// WithCreateStream makes NewDeadLetter create a stream with cfg when no
// stream captures the subject, instead of failing. cfg.Name is required;
// cfg.Subjects, when empty, is the dead-letter subject alone, and must
// otherwise include it. A stream that already captures the subject is used
// as it is, whatever cfg says. Default: the stream must exist.
func WithCreateStream(cfg jetstream.StreamConfig) DeadLetterOption {
	return func(o *deadLetterOptions) error {
		if cfg.Name == "" {
			return errors.New("jetstream.WithCreateStream: name the dead-letter stream (StreamConfig.Name)")
		}
		c := cfg
		o.create = &c
		return nil
	}
}

// NewDeadLetter returns a DeadLetter publishing to subject. It checks that a
// stream captures the subject, or creates one (WithCreateStream); ctx bounds
// those calls. A stream that stops capturing the subject later makes each
// Send fail (no responders), and the original is kept.
func NewDeadLetter(ctx context.Context, js jetstream.JetStream, subject string, opts ...DeadLetterOption) (*DeadLetter, error) {
	if js == nil {
		return nil, errors.New("jetstream.NewDeadLetter: nil JetStream; pass jetstream.New(nc)")
	}
	if subject == "" || strings.ContainsAny(subject, " \t\r\n*>") {
		return nil, fmt.Errorf("jetstream.NewDeadLetter(%q): name one subject, without wildcards or white space", subject)
	}
	var o deadLetterOptions
	if err := option.Apply(&o, opts); err != nil {
		return nil, err
	}
	stream, err := js.StreamNameBySubject(ctx, subject)
	if errors.Is(err, jetstream.ErrStreamNotFound) && o.create != nil {
		cfg := *o.create
		if len(cfg.Subjects) == 0 {
			cfg.Subjects = []string{subject}
		}
		if _, cerr := js.CreateStream(ctx, cfg); cerr != nil {
			return nil, fmt.Errorf("jetstream.NewDeadLetter(%q): creating stream %q (WithCreateStream): %w", subject, cfg.Name, cerr)
		}
		stream, err = js.StreamNameBySubject(ctx, subject)
		if err != nil {
			return nil, fmt.Errorf("jetstream.NewDeadLetter(%q): stream %q, created by WithCreateStream, does not capture the subject; include it in StreamConfig.Subjects: %w", subject, cfg.Name, err)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("jetstream.NewDeadLetter(%q): no stream captures the subject (create one whose subjects include it, or pass WithCreateStream): %w", subject, err)
	}
	return &DeadLetter{js: js, subject: subject, stream: stream}, nil
}

// Subject returns the subject copies are published to.
func (q *DeadLetter) Subject() string { return q.subject }

// SettlesOriginal reports whether Send terminated d: true for a delivery of
// a Source whose term the server answered, false otherwise (the runtime then
// acks it).
func (q *DeadLetter) SettlesOriginal(d *adapters.Delivery) bool {
	h, ok := d.Handle.(*handle)
	if !ok {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.state == stateTermed
}

// Stream returns the stream that stores the copies.
func (q *DeadLetter) Stream() string { return q.stream }

// Send publishes a copy of d with the failure's diagnostics, waits for the
// stream's PubAck, then terminates the original if it came from a Source.
func (q *DeadLetter) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	msg := q.message(d, f)
	if _, err := q.js.PublishMsg(ctx, msg, jetstream.WithMsgID(deduplicationID(d))); err != nil {
		return fmt.Errorf("jetstream: publishing message %s to dead-letter subject %q (the original is kept): %w", d.ID, q.subject, err)
	}
	if h, ok := d.Handle.(*handle); ok {
		// A failed term leaves the original to the runtime's ack.
		_ = h.src.term(ctx, []*adapters.Delivery{d})
	}
	return nil
}

// message builds the copy of d.
func (q *DeadLetter) message(d *adapters.Delivery, f adapters.Failure) *nats.Msg {
	m := &nats.Msg{Subject: q.subject, Data: d.Body, Header: nats.Header{}}
	refused := map[string]string{}
	// What an earlier trip kept of the message's own headers stays, unless
	// the message has that header again.
	if earlier, ok := d.Headers[HeaderOriginalHeaders]; ok {
		var kept map[string]string
		if json.Unmarshal([]byte(earlier), &kept) == nil {
			for k, v := range kept {
				if _, live := d.Headers[k]; !live && !adapters.IsDiagnosticHeader(k) && k != HeaderOriginalSubject {
					refused[k] = v
				}
			}
		}
	}
	for k, v := range d.Headers {
		switch {
		case adapters.IsDiagnosticHeader(k), k == HeaderOriginalSubject, k == HeaderOriginalHeaders, k == HeaderDroppedHeaders:
			// The earlier trip's diagnostics: this copy has its own.
		case !headerNameTravels(k) || !headerValueTravels(v):
			refused[k] = v
		default:
			m.Header.Set(k, v)
		}
	}
	if dropped := fitHeaders(m.Header, refused); len(dropped) > 0 {
		js, _ := json.Marshal(dropped)
		m.Header.Set(HeaderDroppedHeaders, string(js))
	}
	for k, v := range adapters.Diagnostics(d, f) {
		m.Header.Set(k, lineBreaks.Replace(v))
	}
	if nm, ok := Message(d); ok {
		m.Header.Set(HeaderOriginalSubject, nm.Subject())
	}
	if len(refused) > 0 {
		js, err := json.Marshal(refused)
		if err == nil {
			m.Header.Set(HeaderOriginalHeaders, string(js))
		}
	}
	return m
}

// fitHeaders drops the largest of the original's headers (those set in h,
// and those in refused) until they fit headerBudget, and returns the names
// dropped.
func fitHeaders(h nats.Header, refused map[string]string) []string {
	size := 0
	type entry struct {
		name    string
		size    int
		refused bool
	}
	var all []entry
	for k, vs := range h {
		n := len(k) + len(vs[0]) + 4 // "k: v\r\n"
		size += n
		all = append(all, entry{k, n, false})
	}
	for k, v := range refused {
		kj, _ := json.Marshal(k)
		vj, _ := json.Marshal(v)
		n := len(kj) + len(vj) + 2 // "k":"v",
		size += n
		all = append(all, entry{k, n, true})
	}
	if size <= headerBudget {
		return nil
	}
	slices.SortFunc(all, func(a, b entry) int { return b.size - a.size })
	var dropped []string
	for _, e := range all {
		if size <= headerBudget {
			break
		}
		size -= e.size
		dropped = append(dropped, e.name)
		if e.refused {
			delete(refused, e.name)
		} else {
			h.Del(e.name)
		}
	}
	return dropped
}

// headerNameTravels reports whether a header name arrives as it was sent:
// not empty, no colon, white space or control characters, and not one of
// the server's own Nats-* headers.
func headerNameTravels(k string) bool {
	if k == "" || len(k) >= 5 && strings.EqualFold(k[:5], "nats-") {
		return false
	}
	for i := 0; i < len(k); i++ {
		if c := k[i]; c <= ' ' || c == ':' || c == 0x7f {
			return false
		}
	}
	return true
}

// headerValueTravels reports whether a header value arrives as it was
// sent: NATS ends a value at a line break and trims leading white space.
func headerValueTravels(v string) bool {
	if strings.ContainsAny(v, "\r\n") {
		return false
	}
	return v == "" || (v[0] != ' ' && v[0] != '\t')
}

// lineBreaks writes line breaks in a diagnostic as \r and \n, which NATS
// headers cannot hold.
var lineBreaks = strings.NewReplacer("\r", `\r`, "\n", `\n`)

// deduplicationID is the Nats-Msg-Id of d's copy: the same for every Send of
// one delivery, so that a publish repeated after its PubAck was lost is
// stored once, and different for every other delivery, so that the stream
// never drops a copy as a duplicate of another. For a Source's delivery the
// stream, sequence and delivery count tell it apart; a delivery from another
// broker is told apart by everything it carries.
func deduplicationID(d *adapters.Delivery) string {
	h := sha256.New()
	var n [8]byte
	number := func(i int64) {
		binary.BigEndian.PutUint64(n[:], uint64(i))
		h.Write(n[:])
	}
	field := func(s string) {
		number(int64(len(s)))
		io.WriteString(h, s)
	}
	instant := func(t time.Time) {
		number(t.Unix())
		number(int64(t.Nanosecond()))
	}
	field(d.ID)
	field(d.Queue)
	number(int64(d.Attempt))
	if _, ok := d.Handle.(*handle); !ok {
		number(int64(d.Partition))
		number(d.Offset)
		field(d.Key)
		instant(d.PublishedAt)
		instant(d.FirstReceivedAt)
		instant(d.ReceivedAt)
		field(string(d.Body))
		names := make([]string, 0, len(d.Headers))
		for k := range d.Headers {
			names = append(names, k)
		}
		slices.Sort(names)
		number(int64(len(names)))
		for _, k := range names {
			field(k)
			field(d.Headers[k])
		}
	}
	return "custody-dl-" + hex.EncodeToString(h.Sum(nil)[:20])
}

// NativeDeadLetter returns a DeadLetter that leaves poison messages in the
// stream, to the consumer's MaxDeliver and the server's advisories, instead
// of copying them. maxAttempts is the consumer's Retry.MaxAttempts; the
// consumer's MaxDeliver must equal it.
//
// At the last attempt Send naks the message: the server counts it past
// MaxDeliver, stops delivering it and publishes a MAX_DELIVERIES advisory
// ($JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>, with the
// stream sequence). A permanent error before the last attempt terminates it
// instead (+TERM; advisory $JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED...).
// The message stays in the stream, under its retention, where an operator
// reads it by sequence; the runtime's diagnostics are only logged and
// counted. Send returns nil only once the server answered, and settles the
// original itself (adapters.OriginalSettler).
//
// MaxDeliver counts deliveries, not handler runs: a delivery given back
// before its handler started (at shutdown, or queued behind a lost message
// of its ordering key) or lost with its connection uses one up, so a
// message may be left after fewer handler runs than maxAttempts, or none.
// NewDeadLetter has no such limit: the runtime dead-letters only after
// running the handler.
func (s *Source) NativeDeadLetter(maxAttempts int) (adapters.DeadLetter, error) {
	if maxAttempts < 1 {
		return nil, fmt.Errorf("jetstream: Source.NativeDeadLetter(%d): maxAttempts must be the consumer's Retry.MaxAttempts, at least 1", maxAttempts)
	}
	if md := s.info.MaxDeliver; md != maxAttempts {
		return nil, fmt.Errorf("jetstream: Source.NativeDeadLetter(%d): consumer %q has MaxDeliver %d; set it to the runtime's MaxAttempts (%d) so that the server stops delivering a message exactly when the runtime gives up on it, or use NewDeadLetter",
			maxAttempts, s.consumer, md, maxAttempts)
	}
	return &nativeDeadLetter{s: s, maxDeliver: maxAttempts}, nil
}

type nativeDeadLetter struct {
	s          *Source
	maxDeliver int
}

func (n *nativeDeadLetter) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	h, ok := d.Handle.(*handle)
	if !ok || h.src != n.s {
		return fmt.Errorf("jetstream: the native dead letter of consumer %q cannot take message %s of %q", n.s.consumer, d.ID, d.Queue)
	}
	var err error
	if d.Attempt >= n.maxDeliver {
		err = n.s.settle(ctx, []*adapters.Delivery{d}, opNak, func(int) []byte { return ackNak }, stateLeft)
	} else {
		err = n.s.term(ctx, []*adapters.Delivery{d})
	}
	if err = adapters.EntryError(err, 0); err != nil {
		return fmt.Errorf("jetstream: leaving message %s to the server's MaxDeliver: %w", d.ID, err)
	}
	return nil
}

// SettlesOriginal reports true: Send returns nil only once the server took
// the nak or the term.
func (n *nativeDeadLetter) SettlesOriginal(*adapters.Delivery) bool { return true }
