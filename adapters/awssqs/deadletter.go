package awssqs

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
)

// Defaults for the DeadLetterQueue's options.
const (
	// DefaultDiagnosticsAttribute names the message attribute that carries
	// the diagnostics as one JSON object.
	DefaultDiagnosticsAttribute = "custody-diagnostics"
	// DefaultMaxMessageSize is SQS's default MaximumMessageSize, 256 KiB.
	DefaultMaxMessageSize = 256 << 10
	// maxAttributes is SQS's limit on message attributes per message.
	maxAttributes = 10
	// Extra keys the DeadLetterQueue adds to the diagnostics JSON.
	diagGroupID      = "custody-original-group-id"
	diagDedupID      = "custody-original-deduplication-id"
	diagAttrPrefix   = "custody-original-attribute."
	minErrorTextKept = 64
)

// DeadLetterQueue is an adapters.DeadLetter that sends failed messages to an
// SQS queue of your choosing. The copy keeps the original body and message
// attributes and adds one attribute (custody-diagnostics) holding a JSON
// object of the diagnostic headers (package adapters' Header* names: error,
// attempts, first and last failure, original queue and message id, ...). One
// attribute keeps the copy within SQS's limit of ten per message; when the
// original already has ten, the ones that do not fit travel inside the JSON
// as "custody-original-attribute.NAME".
//
// For a FIFO dead-letter queue the copy keeps the original's MessageGroupId
// (or "custody-dead-letter" when the original has none). Its deduplication id
// is derived from the original's and from the receipt handle, so a Send
// retried for the same delivery is stored once while a message that fails
// again after being redriven is stored again. The original group and
// deduplication ids are also in the diagnostics.
//
// Send returns nil only when SQS has accepted the copy; the runtime deletes
// the original only then.
type DeadLetterQueue struct {
	client  Sender
	url     string
	fifo    bool
	attr    string
	maxSize int
}

var _ adapters.DeadLetter = (*DeadLetterQueue)(nil)

// DeadLetterOption configures a [DeadLetterQueue].
type DeadLetterOption func(*DeadLetterQueue) error

// WithDiagnosticsAttribute names the attribute carrying the diagnostics
// JSON. Default "custody-diagnostics".
func WithDiagnosticsAttribute(name string) DeadLetterOption {
	return func(q *DeadLetterQueue) error {
		if name == "" || len(name) > 256 || strings.HasPrefix(strings.ToLower(name), "aws.") || strings.HasPrefix(strings.ToLower(name), "amazon.") {
			return fmt.Errorf("awssqs.WithDiagnosticsAttribute(%q): must be 1 to 256 characters and not start with AWS. or Amazon.", name)
		}
		q.attr = name
		return nil
	}
}

// WithMaxMessageSize sets the largest copy Send will try, in bytes (body plus
// attribute names, types and values, as SQS counts them), from 1 KiB to
// 1 MiB. Default 256 KiB; set it to the dead-letter queue's
// MaximumMessageSize. When a copy is larger, Send shortens the error text;
// if it is still too large, Send fails and the original stays in its queue.
func WithMaxMessageSize(n int) DeadLetterOption {
	return func(q *DeadLetterQueue) error {
		if n < 1<<10 || n > 1<<20 {
			return fmt.Errorf("awssqs.WithMaxMessageSize(%d): must be from 1024 to 1048576 bytes", n)
		}
		q.maxSize = n
		return nil
	}
}

// NewDeadLetterQueue returns a DeadLetter sending to the queue at queueURL.
// A URL ending in .fifo is treated as a FIFO queue.
//
// It also takes deliveries from other brokers. Their headers become String
// attributes where SQS allows the name and the value; the others (names with
// characters SQS refuses, empty values, values that are not text) travel in
// the diagnostics as "custody-original-attribute.NAME". A body that is not
// text SQS accepts is sent base64-encoded, and an empty one as a single
// space; the diagnostics then say so in "custody-body-encoding" ("base64" or
// "empty").
func NewDeadLetterQueue(client Sender, queueURL string, opts ...DeadLetterOption) (*DeadLetterQueue, error) {
	if client == nil {
		return nil, fmt.Errorf("awssqs.NewDeadLetterQueue: nil client; pass an *sqs.Client")
	}
	name, err := queueName(queueURL)
	if err != nil {
		return nil, fmt.Errorf("awssqs.NewDeadLetterQueue: %w", err)
	}
	q := &DeadLetterQueue{client: client, url: queueURL, fifo: strings.HasSuffix(name, ".fifo"), attr: DefaultDiagnosticsAttribute, maxSize: DefaultMaxMessageSize}
	for _, opt := range opts {
		if opt == nil {
			continue
		}
		if err := opt(q); err != nil {
			return nil, err
		}
	}
	return q, nil
}

// Send stores a copy of d with the failure's diagnostics in the dead-letter
// queue and returns nil once SQS has accepted it.
func (q *DeadLetterQueue) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
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
func (q *DeadLetterQueue) message(d *adapters.Delivery, f adapters.Failure) (*sqs.SendMessageInput, error) {
	diag := adapters.Diagnostics(d, f)
	body := string(d.Body)
	var attrs map[string]types.MessageAttributeValue
	if m, ok := Message(d); ok {
		attrs = nativeAttributes(m)
	} else {
		// Another broker's delivery: what SQS would refuse travels in the
		// diagnostics (see foreign.go).
		var refused map[string]string
		attrs, refused = foreignAttributes(d)
		for k, v := range refused {
			diag[diagAttrPrefix+k] = v
		}
		var encoding string
		if body, encoding = foreignBody(d.Body); encoding != "" {
			diag[diagBodyEncoding] = encoding
		}
	}
	delete(attrs, q.attr) // a message dead-lettered twice gets fresh diagnostics
	names := make([]string, 0, len(attrs))
	for k := range attrs {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names[min(len(names), maxAttributes-1):] {
		diag[diagAttrPrefix+k] = attributeString(attrs[k])
		delete(attrs, k)
	}
	group, dedup := GroupID(d), DeduplicationID(d)
	if group != "" {
		diag[diagGroupID] = group
	}
	if dedup != "" {
		diag[diagDedupID] = dedup
	}

	in := &sqs.SendMessageInput{
		QueueUrl:          aws.String(q.url),
		MessageBody:       aws.String(body),
		MessageAttributes: attrs,
	}
	if q.fifo {
		if group == "" {
			group = "custody-dead-letter"
		}
		if dedup == "" {
			dedup = d.ID
		}
		sum := sha256.Sum256([]byte(dedup + "\x00" + receipt(d)))
		in.MessageGroupId = aws.String(group)
		in.MessageDeduplicationId = aws.String(hex.EncodeToString(sum[:]))
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
			return nil, fmt.Errorf("awssqs: the dead-letter copy of message %s is %d bytes, over the %d-byte limit (WithMaxMessageSize); the original stays in its queue: raise the limit up to the dead-letter queue's MaximumMessageSize, or use Source.Redrive",
				d.ID, size, q.maxSize)
		}
		cut := max(minErrorTextKept, len(msg)-(size-q.maxSize))
		diag[adapters.HeaderError] = strings.ToValidUTF8(msg[:cut], "")
	}
}

// escapeNonCharacters writes U+FFFE and U+FFFF in JSON text as escapes.
// encoding/json leaves them raw, but SQS rejects a string attribute holding
// them (it accepts the same characters as in a body), and an error text may
// contain them; the escapes decode to the same text.
func escapeNonCharacters(js []byte) []byte {
	js = bytes.ReplaceAll(js, []byte("\uFFFE"), []byte(`\ufffe`))
	return bytes.ReplaceAll(js, []byte("\uFFFF"), []byte(`\uffff`))
}

// nativeAttributes returns a received SQS message's attributes with their
// SQS types.
func nativeAttributes(m types.Message) map[string]types.MessageAttributeValue {
	attrs := map[string]types.MessageAttributeValue{}
	for k, v := range m.MessageAttributes {
		attrs[k] = types.MessageAttributeValue{DataType: v.DataType, StringValue: v.StringValue, BinaryValue: v.BinaryValue}
	}
	return attrs
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
