package awssqs

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/option"
)

// Defaults for the DeadLetter's options.
const (
	// DefaultDiagnosticsAttribute names the message attribute that carries
	// the diagnostics as one JSON object.
	DefaultDiagnosticsAttribute = "custody-diagnostics"
	// DefaultMaxMessageSize, 256 KiB, is the largest copy sent to a queue
	// that does not report its MaximumMessageSize.
	DefaultMaxMessageSize = 256 << 10
	// maxAttributes is SQS's limit on message attributes per message.
	maxAttributes = 10
	// Extra keys the DeadLetter adds to the diagnostics JSON.
	diagGroupID      = "custody-original-group-id"
	diagDedupID      = "custody-original-deduplication-id"
	diagAttrPrefix   = "custody-original-attribute."
	minErrorTextKept = 64
)

// DeadLetter is an adapters.DeadLetter that sends failed messages to an
// SQS queue of your choosing. The copy keeps the original body, message
// attributes and X-Ray trace header (the AWSTraceHeader system attribute),
// and adds one attribute (custody-diagnostics) holding a JSON object of the
// diagnostic headers (package adapters' Header* names). One attribute keeps
// the copy within SQS's limit of ten per message; when the original already
// has ten, those that do not fit travel inside the JSON as
// "custody-original-attribute.NAME": to read a copy back as the original
// message, take those keys as attributes NAME (see also NewDeadLetter for
// the body of another broker's delivery).
//
// A message dead-lettered before and replayed (by SQS's StartMessageMoveTask,
// say) gets fresh diagnostics: the copy drops the earlier diagnostics
// attribute and any attribute or header named like a diagnostic header
// (adapters.IsDiagnosticHeader; another broker's dead-letter destination
// writes them so). What the earlier diagnostics held of the message itself
// stays: its "custody-original-attribute.NAME" keys (unless the message has
// an attribute NAME again) and, for an SQS message, its
// "custody-body-encoding".
//
// For a FIFO dead-letter queue the copy keeps the original's MessageGroupId.
// A message from another broker gets its ordering key as the group (a Kafka
// partition or key: the order its source kept), hashed when SQS would refuse
// it as a group id; one without an ordering key gets a group of its own, so
// that no copy waits behind another it has no order with. Its deduplication
// id is the same for every Send of one delivery, so a Send retried after its
// answer was lost is stored once, and differs between deliveries, so that
// SQS (which drops a message whose deduplication id it saw in the last five
// minutes, and reports it sent) never drops a copy whose original the
// runtime then deletes: it is a hash of the delivery, its receipt handle
// included, so a message that fails again after another receive is stored
// again. The original group and deduplication ids are also in the
// diagnostics.
//
// Send returns nil only when SQS has accepted the copy; the runtime deletes
// the original only then.
type DeadLetter struct {
	client  Sender
	url     string
	fifo    bool
	attr    string
	maxSize int
	sizeSet bool // maxSize came from WithMaxMessageSize
}

var _ adapters.DeadLetter = (*DeadLetter)(nil)

// DeadLetterOption configures a [DeadLetter].
type DeadLetterOption func(*DeadLetter) error

// WithDiagnosticsAttribute names the attribute carrying the diagnostics
// JSON. Default "custody-diagnostics". The name must be one SQS accepts for a
// message attribute: 1 to 256 letters, digits, '_', '-' and '.', with no
// leading, trailing or doubled '.', and no AWS. or Amazon. prefix.
func WithDiagnosticsAttribute(name string) DeadLetterOption {
	return func(q *DeadLetter) error {
		// SQS would refuse every copy, and the originals would never
		// leave their queues.
		if !validAttributeName(name) {
			return fmt.Errorf("awssqs.WithDiagnosticsAttribute(%q): SQS refuses that attribute name; use 1 to 256 letters, digits, '_', '-' and '.', with no leading, trailing or doubled '.', not starting with \"AWS.\" or \"Amazon.\"", name)
		}
		q.attr = name
		return nil
	}
}

// WithMaxMessageSize sets the largest copy Send will try, in bytes (body plus
// attribute names, types and values, as SQS counts them), from 1 KiB to
// 1 MiB. Default: the dead-letter queue's MaximumMessageSize, which
// NewDeadLetter reads (DefaultMaxMessageSize if the queue reports
// none); NewDeadLetter refuses a larger value, since SQS would refuse
// the copies in between. When a copy is larger, Send shortens the error
// text; if it is still too large, Send fails and the original stays in its
// queue.
func WithMaxMessageSize(n int) DeadLetterOption {
	return func(q *DeadLetter) error {
		if n < 1<<10 || n > 1<<20 {
			return fmt.Errorf("awssqs.WithMaxMessageSize(%d): must be from 1024 to 1048576 bytes", n)
		}
		q.maxSize = n
		q.sizeSet = true
		return nil
	}
}

// NewDeadLetter returns a DeadLetter sending to the queue at queueURL.
// It reads the queue's attributes once (GetQueueAttributes, bounded by ctx),
// so that a wrong URL, region, endpoint or credentials fail here rather than
// at every attempt to dead-letter the first poison message. Whether the
// queue is FIFO comes from its FifoQueue attribute (or a name ending in
// .fifo), and the largest copy from its MaximumMessageSize (see
// WithMaxMessageSize). The check does not show that the client may send:
// the sink needs sqs:GetQueueAttributes and sqs:SendMessage on the queue.
//
// It also takes deliveries from other brokers. Their headers become String
// attributes where SQS allows the name and the value; the others (names with
// characters SQS refuses, empty values, values that are not text) travel in
// the diagnostics as "custody-original-attribute.NAME". A body that is not
// text SQS accepts is sent base64-encoded, and an empty one as a single
// space; the diagnostics then say so in "custody-body-encoding" ("base64":
// standard base64 of the original body; "empty": the original body was
// empty).
func NewDeadLetter(ctx context.Context, client Sender, queueURL string, opts ...DeadLetterOption) (*DeadLetter, error) {
	q, err := newDeadLetter(client, queueURL, opts)
	if err != nil {
		return nil, err
	}
	out, err := client.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{
		QueueUrl:       aws.String(queueURL),
		AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameFifoQueue, types.QueueAttributeNameMaximumMessageSize},
	})
	if err != nil {
		var missing *types.QueueDoesNotExist
		if errors.As(err, &missing) {
			return nil, fmt.Errorf("awssqs.NewDeadLetter: dead-letter queue %s does not exist where the client looks (check the queue name and account in the URL, and the client's region and endpoint; create the queue first): %w", queueURL, err)
		}
		return nil, fmt.Errorf("awssqs.NewDeadLetter: cannot read the attributes of dead-letter queue %s (check the URL, the client's region, endpoint and credentials; the sink needs sqs:GetQueueAttributes and sqs:SendMessage on the queue): %w", queueURL, err)
	}
	if out.Attributes[string(types.QueueAttributeNameFifoQueue)] == "true" {
		q.fifo = true
	}
	if n, err := strconv.Atoi(out.Attributes[string(types.QueueAttributeNameMaximumMessageSize)]); err == nil && n > 0 {
		if q.sizeSet && q.maxSize > n {
			// SQS would refuse the copies between the two sizes.
			return nil, fmt.Errorf("awssqs.WithMaxMessageSize(%d): dead-letter queue %s takes messages of at most %d bytes (its MaximumMessageSize); lower the option or raise the queue's MaximumMessageSize", q.maxSize, queueURL, n)
		}
		if !q.sizeSet {
			q.maxSize = min(max(n, 1<<10), 1<<20)
		}
	}
	return q, nil
}

// newDeadLetter builds the sink from its arguments and options, without
// a call to SQS: a FIFO queue is recognised by its name alone.
func newDeadLetter(client Sender, queueURL string, opts []DeadLetterOption) (*DeadLetter, error) {
	if client == nil {
		return nil, fmt.Errorf("awssqs.NewDeadLetter: nil client; pass an *sqs.Client")
	}
	name, err := queueName(queueURL)
	if err != nil {
		return nil, fmt.Errorf("awssqs.NewDeadLetter: %w", err)
	}
	q := &DeadLetter{client: client, url: queueURL, fifo: strings.HasSuffix(name, ".fifo"), attr: DefaultDiagnosticsAttribute, maxSize: DefaultMaxMessageSize}
	if err := option.Apply(q, opts); err != nil {
		return nil, err
	}
	return q, nil
}

// FIFO reports whether the dead-letter queue is a FIFO queue. A FIFO
// source's copies keep their group order only in a FIFO dead-letter queue;
// the sink cannot check the pairing itself, since it takes messages from
// any source: compare with [Source.FIFO] where both are built.
func (q *DeadLetter) FIFO() bool { return q.fifo }

// Send stores a copy of d with the failure's diagnostics in the dead-letter
// queue and returns nil once SQS has accepted it.
func (q *DeadLetter) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	in, err := q.message(d, f)
	if err != nil {
		return err
	}
	if _, err := q.client.SendMessage(ctx, in); err != nil {
		return fmt.Errorf("awssqs: sending message %s to dead-letter queue %s (the original stays in its queue): %w", d.ID, q.url, err)
	}
	return nil
}

// message builds the SendMessage input for d.
func (q *DeadLetter) message(d *adapters.Delivery, f adapters.Failure) (*sqs.SendMessageInput, error) {
	diag := adapters.Diagnostics(d, f)
	body := string(d.Body)
	var (
		attrs   map[string]types.MessageAttributeValue
		refused map[string]string
		earlier map[string]string // the diagnostics of an earlier trip, if d carries them
		system  map[string]types.MessageSystemAttributeValue
	)
	m, native := Message(d)
	if native {
		attrs = nativeAttributes(m)
		if v, ok := attrs[q.attr]; ok {
			earlier = decodeDiagnostics(attributeString(v))
		}
		system = traceAttribute(m)
	} else {
		// Another broker's delivery: what SQS would refuse travels in the
		// diagnostics (see foreign.go).
		attrs, refused = foreignAttributes(d)
		if v, ok := d.Headers[q.attr]; ok {
			earlier = decodeDiagnostics(v)
		}
	}
	// An earlier trip's diagnostics go (see DeadLetter); carryOver keeps
	// what they held of the message itself.
	for k := range attrs {
		if q.stale(k) {
			delete(attrs, k)
		}
	}
	q.carryOver(diag, earlier, native, func(name string) bool {
		_, attr := attrs[name]
		_, header := refused[name]
		return attr || header
	})
	for k, v := range refused {
		if !q.stale(k) {
			diag[diagAttrPrefix+k] = v
		}
	}
	if !native {
		var encoding string
		if body, encoding = foreignBody(d.Body); encoding != "" {
			diag[diagBodyEncoding] = encoding
		}
	}
	names := make([]string, 0, len(attrs))
	for k := range attrs {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names[min(len(names), maxAttributes-1):] {
		diag[diagAttrPrefix+k] = attributeString(attrs[k])
		delete(attrs, k)
	}
	group := GroupID(d)
	if group != "" {
		diag[diagGroupID] = group
	}
	if dedup := DeduplicationID(d); dedup != "" {
		diag[diagDedupID] = dedup
	}

	in := &sqs.SendMessageInput{
		QueueUrl:                aws.String(q.url),
		MessageBody:             aws.String(body),
		MessageAttributes:       attrs,
		MessageSystemAttributes: system,
	}
	if q.fifo {
		dedup := deduplicationID(d)
		if group == "" {
			group = foreignGroup(d, dedup)
		}
		in.MessageGroupId = aws.String(group)
		in.MessageDeduplicationId = aws.String(dedup)
	}

	for {
		js, err := json.Marshal(diag)
		if err != nil {
			return nil, fmt.Errorf("awssqs: encoding dead-letter diagnostics: %w", err)
		}
		js = escapeNonCharacters(js)
		attrs[q.attr] = types.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(string(js))}
		size := messageSize(in)
		if size <= q.maxSize {
			return in, nil
		}
		msg := diag[adapters.HeaderError]
		if len(msg) <= minErrorTextKept {
			return nil, fmt.Errorf("awssqs: the dead-letter copy of message %s is %d bytes, over the %d-byte limit (WithMaxMessageSize); the original stays in its queue: raise the limit up to the dead-letter queue's MaximumMessageSize, or use Source.NativeDeadLetter",
				d.ID, size, q.maxSize)
		}
		cut := max(minErrorTextKept, len(msg)-(size-q.maxSize))
		diag[adapters.HeaderError] = strings.ToValidUTF8(msg[:cut], "")
	}
}

// stale reports whether an attribute or header of the message being copied
// is diagnostics of an earlier trip to a dead-letter destination, which the
// copy replaces.
func (q *DeadLetter) stale(name string) bool {
	return name == q.attr || adapters.IsDiagnosticHeader(name)
}

// carryOver copies into diag what the diagnostics of an earlier trip
// (earlier, nil if none) say about the message itself: the attributes that
// travelled in them, unless the message has one of that name again (has
// reports it; the live one wins), and, for a message received from SQS
// (whose body is the earlier copy's, unchanged), how its body is encoded.
func (q *DeadLetter) carryOver(diag, earlier map[string]string, native bool, has func(name string) bool) {
	for k, v := range earlier {
		if name, ok := strings.CutPrefix(k, diagAttrPrefix); ok && name != "" && !q.stale(name) && !has(name) {
			diag[k] = v
		}
	}
	if native {
		if e := earlier[diagBodyEncoding]; e == "base64" || e == "empty" {
			diag[diagBodyEncoding] = e
		}
	}
}

// decodeDiagnostics parses a diagnostics JSON object; nil if raw is not one.
func decodeDiagnostics(raw string) map[string]string {
	var diag map[string]string
	if json.Unmarshal([]byte(raw), &diag) != nil {
		return nil
	}
	return diag
}

// foreignGroup is the FIFO group of the copy of a delivery from another
// broker: its ordering key, or a digest of it where SQS would refuse it (over
// 128 characters, or characters other than ASCII letters, digits and
// punctuation); without one, the copy's deduplication id, a group of its own.
func foreignGroup(d *adapters.Delivery, dedup string) string {
	k := d.OrderingKey
	if k == "" {
		return dedup
	}
	if len(k) <= 128 && strings.IndexFunc(k, func(r rune) bool { return r <= ' ' || r > '~' }) < 0 {
		return k
	}
	sum := sha256.Sum256([]byte(k))
	return "custody-lane-" + hex.EncodeToString(sum[:20])
}

// deduplicationID returns the MessageDeduplicationId of d's copy in a FIFO
// dead-letter queue (see DeadLetter): a hash of everything d carries, down
// to the nanosecond it was received, since another broker's message id alone
// may repeat (an AMQP message-id is the publisher's choice, and often
// empty).
func deduplicationID(d *adapters.Delivery) string {
	h := sha256.New()
	var n [8]byte
	field := func(s string) {
		binary.BigEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		io.WriteString(h, s)
	}
	number := func(i int64) {
		binary.BigEndian.PutUint64(n[:], uint64(i))
		h.Write(n[:])
	}
	instant := func(t time.Time) {
		number(t.Unix())
		number(int64(t.Nanosecond()))
	}
	field(d.ID)
	field(receipt(d))
	field(DeduplicationID(d))
	field(d.Queue)
	number(int64(d.Partition))
	number(d.Offset)
	field(d.Key)
	number(int64(d.Attempt))
	instant(d.PublishedAt)
	instant(d.FirstReceivedAt)
	instant(d.ReceivedAt)
	number(int64(len(d.Body)))
	h.Write(d.Body)
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
	return hex.EncodeToString(h.Sum(nil))
}

// escapeNonCharacters writes U+FFFE and U+FFFF in JSON text as escapes.
// encoding/json leaves them raw, but SQS rejects a string attribute holding
// them (it accepts the same characters as in a body), and an error text may
// contain them; the escapes decode to the same text.
func escapeNonCharacters(js []byte) []byte {
	js = bytes.ReplaceAll(js, []byte("\uFFFE"), []byte(`\ufffe`))
	return bytes.ReplaceAll(js, []byte("\uFFFF"), []byte(`\uffff`))
}

// nativeAttributes returns a copy of a received SQS message's attributes.
func nativeAttributes(m types.Message) map[string]types.MessageAttributeValue {
	attrs := map[string]types.MessageAttributeValue{}
	for k, v := range m.MessageAttributes {
		attrs[k] = types.MessageAttributeValue{DataType: v.DataType, StringValue: v.StringValue, BinaryValue: v.BinaryValue}
	}
	return attrs
}

// traceAttribute returns the system attributes that give a copy of m the
// X-Ray trace m was sent in (nil if none): SQS keeps it apart from the
// message attributes, and sets it on a copy only when asked to.
func traceAttribute(m types.Message) map[string]types.MessageSystemAttributeValue {
	trace := m.Attributes[string(types.MessageSystemAttributeNameAWSTraceHeader)]
	if trace == "" {
		return nil
	}
	return map[string]types.MessageSystemAttributeValue{
		string(types.MessageSystemAttributeNameForSendsAWSTraceHeader): {DataType: aws.String("String"), StringValue: aws.String(trace)},
	}
}

// messageSize is the size SQS counts against MaximumMessageSize: the body
// plus each attribute's name, data type and value.
func messageSize(in *sqs.SendMessageInput) int {
	n := len(aws.ToString(in.MessageBody))
	for k, v := range in.MessageAttributes {
		n += len(k) + len(aws.ToString(v.DataType)) + len(aws.ToString(v.StringValue)) + len(v.BinaryValue)
	}
	return n
}

// DecodeDiagnostics reads the diagnostics JSON from a dead-lettered message's
// attributes (attribute name: DefaultDiagnosticsAttribute unless configured).
func DecodeDiagnostics(attrs map[string]types.MessageAttributeValue, name string) (map[string]string, error) {
	v, ok := attrs[name]
	if !ok {
		return nil, fmt.Errorf("awssqs: no %q attribute on the message", name)
	}
	var diag map[string]string
	raw := aws.ToString(v.StringValue)
	if raw == "" && len(v.BinaryValue) > 0 {
		raw = string(v.BinaryValue)
	}
	if err := json.Unmarshal([]byte(raw), &diag); err != nil {
		return nil, fmt.Errorf("awssqs: attribute %q is not a diagnostics JSON object: %w", name, err)
	}
	return diag, nil
}
