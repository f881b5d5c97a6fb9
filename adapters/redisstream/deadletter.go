package redisstream

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/option"
)

// DeadLetter is an adapters.DeadLetter that appends failed messages to a
// Redis stream. The copy holds the body in the body field
// (WithDeadLetterBodyField, default "body"), every header as a field of its
// own (one named like the body field as "custody-header.NAME"), and the
// runtime's diagnostics as fields named like package adapters' Header*
// constants (custody-error, custody-attempts, custody-original-id, ...).
// An earlier trip's diagnostic fields (a dead letter replayed into its
// stream) are dropped.
//
// For an entry of a [Source], Send appends the copy and acknowledges the
// original in one atomic script (XADD, then XACK): a crash or a lost
// connection leaves both done or neither. That needs one server: the Source
// and the DeadLetter must share their client, and on a Redis Cluster (or a
// ring) both streams a hash tag (orders{o} and orders-dlq{o}, say).
// SettlesOriginal reports which deliveries Send acknowledges so. For the
// others Send only appends the copy, and the runtime acknowledges the
// original once Send returned: a crash between the two delivers and
// dead-letters the original again, so the dead-letter stream may hold two
// copies (tell them apart by custody-original-id).
//
// Send returns nil only once the copy is stored.
type DeadLetter struct {
	client    redis.UniversalClient
	stream    string
	bodyField string
	maxLen    int64
}

var (
	_ adapters.DeadLetter      = (*DeadLetter)(nil)
	_ adapters.OriginalSettler = (*DeadLetter)(nil)
)

// DeadLetterOption configures a [DeadLetter].
type DeadLetterOption func(*DeadLetter) error

// WithDeadLetterBodyField names the field that holds the body in the copies.
// Default "body", the Source's default body field.
func WithDeadLetterBodyField(name string) DeadLetterOption {
	return func(q *DeadLetter) error {
		if name == "" {
			return errors.New("redisstream.WithDeadLetterBodyField(\"\"): name a field")
		}
		q.bodyField = name
		return nil
	}
}

// WithDeadLetterMaxLen trims the dead-letter stream to about n entries as
// copies are appended (XADD MAXLEN ~ n), dropping the oldest. Default 0:
// never trimmed.
func WithDeadLetterMaxLen(n int64) DeadLetterOption {
	return func(q *DeadLetter) error {
		if n < 0 {
			return fmt.Errorf("redisstream.WithDeadLetterMaxLen(%d): must not be negative (0: never trim)", n)
		}
		q.maxLen = n
		return nil
	}
}

// NewDeadLetter returns a DeadLetter appending to stream (created by
// the first copy). It checks that the server answers and that the key, if
// it exists, is a stream; ctx bounds that call.
func NewDeadLetter(ctx context.Context, client redis.UniversalClient, stream string, opts ...DeadLetterOption) (*DeadLetter, error) {
	if client == nil {
		return nil, errors.New("redisstream.NewDeadLetter: nil client; pass a go-redis client")
	}
	if stream == "" {
		return nil, errors.New("redisstream.NewDeadLetter: name the dead-letter stream")
	}
	q := &DeadLetter{client: client, stream: stream, bodyField: DefaultBodyField}
	if err := option.Apply(q, opts); err != nil {
		return nil, err
	}
	typ, err := client.Type(ctx, stream).Result()
	if err != nil {
		return nil, fmt.Errorf("redisstream.NewDeadLetter: reaching the server (check the address and credentials): %w", err)
	}
	if typ != "none" && typ != "stream" {
		return nil, fmt.Errorf("redisstream.NewDeadLetter: key %q holds a %s, not a stream; name another key", stream, typ)
	}
	return q, nil
}

// Stream returns the name of the dead-letter stream.
func (q *DeadLetter) Stream() string { return q.stream }

// deadLetterScript appends the copy and acknowledges the original, in that
// order, atomically: a failing XADD (the key replaced by another type, say)
// stops the script before the XACK. (MULTI/EXEC would run the XACK even
// after the XADD failed at run time, acking an original whose copy was never
// stored.) With ARGV[4] = 1 (the Source's WithDeleteOnAck) it deletes the
// original from its stream too, as the Source's own ack would. It returns
// {copy id, entries acked}.
//
//	KEYS[1] dead-letter stream, KEYS[2] the original's stream
//	ARGV[1] group, ARGV[2] original id, ARGV[3] MAXLEN (0: none),
//	ARGV[4] delete the original (0 or 1), ARGV[5..] field, value pairs
var deadLetterScript = redis.NewScript(`
local args = {'XADD', KEYS[1]}
if tonumber(ARGV[3]) > 0 then
  args[#args + 1] = 'MAXLEN'
  args[#args + 1] = '~'
  args[#args + 1] = ARGV[3]
end
args[#args + 1] = '*'
for i = 5, #ARGV do args[#args + 1] = ARGV[i] end
local id = redis.call(unpack(args))
local acked = redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
if ARGV[4] == '1' then redis.call('XDEL', KEYS[2], ARGV[2]) end
return {id, acked}
`)

// maxScriptFields bounds the fields a copy may have to go through the
// script (Lua's unpack takes at most about 8,000 values); a copy with more
// is appended alone, and the runtime acknowledges its original.
const maxScriptFields = 3000

// maxDiagnostics bounds the fields adapters.Diagnostics adds to a copy.
const maxDiagnostics = 32

// Send stores a copy of d with the failure's diagnostics and, for an entry
// of a Source on the same client and slot, acknowledges the original in the
// same script (see DeadLetter and SettlesOriginal).
func (q *DeadLetter) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	fields := q.fields(d, f)
	if src, ok := q.settles(d); ok {
		args := make([]any, 0, 4+len(fields))
		args = append(args, src.group, d.ID, q.maxLen, flag(src.opts.deleteOnAck))
		for _, v := range fields {
			args = append(args, v)
		}
		if err := deadLetterScript.Run(ctx, q.client, []string{q.stream, src.stream}, args...).Err(); err != nil {
			return fmt.Errorf("redisstream: dead-lettering entry %s of stream %q into %q (the original stays pending): %w", d.ID, src.stream, q.stream, err)
		}
		h := heldOf(d)
		h.deadLettered.Store(true)
		h.src.unhold([]*adapters.Delivery{d})
		return nil
	}
	xadd := &redis.XAddArgs{Stream: q.stream, Values: fields}
	if q.maxLen > 0 {
		xadd.MaxLen, xadd.Approx = q.maxLen, true
	}
	if err := q.client.XAdd(ctx, xadd).Err(); err != nil {
		return fmt.Errorf("redisstream: appending message %s to dead-letter stream %q (the original stays where it is): %w", d.ID, q.stream, err)
	}
	return nil
}

// settles returns the Source of d when Send acknowledges d in the script
// that appends its copy: d is an entry of a Source on the same client, in
// the same slot, with few enough headers for the script.
func (q *DeadLetter) settles(d *adapters.Delivery) (*Source, bool) {
	h := heldOf(d)
	if h == nil || h.src.client != q.client || !sameSlot(q.client, q.stream, h.src.stream) {
		return nil, false
	}
	return h.src, 1+len(d.Headers)+maxDiagnostics <= maxScriptFields
}

// SettlesOriginal reports whether Send acknowledges d itself, in the script
// that appends its copy (adapters.OriginalSettler): true for an entry of a
// Source on the same client whose stream shares the dead-letter stream's
// slot. The runtime acks every other delivery through its own source once
// Send returned nil.
func (q *DeadLetter) SettlesOriginal(d *adapters.Delivery) bool {
	_, ok := q.settles(d)
	return ok
}

// fields returns the copy's fields as name, value pairs: the body, the
// headers (sorted, without an earlier trip's diagnostics), the diagnostics
// (sorted).
func (q *DeadLetter) fields(d *adapters.Delivery, f adapters.Failure) []string {
	diag := adapters.Diagnostics(d, f)
	out := make([]string, 0, 2*(1+len(d.Headers)+len(diag)))
	out = append(out, q.bodyField, string(d.Body))
	names := make([]string, 0, len(d.Headers))
	for k := range d.Headers {
		if !adapters.IsDiagnosticHeader(k) {
			names = append(names, k)
		}
	}
	slices.Sort(names)
	for _, k := range names {
		name := k
		if k == q.bodyField {
			name = headerPrefix + k
		}
		out = append(out, name, d.Headers[k])
	}
	names = names[:0]
	for k := range diag {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		out = append(out, k, diag[k])
	}
	return out
}

// headerPrefix marks, in a dead-letter copy, a header whose name is the body
// field's.
const headerPrefix = "custody-header."
