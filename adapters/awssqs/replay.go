package awssqs

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/option"
	"github.com/custody-go/custody/internal/pace"
)

// Defaults for a Replay's options.
const (
	// DefaultReplayHold is how long List and Replay keep the dead letters
	// they received out of other receivers' sight.
	DefaultReplayHold = time.Minute
	// DefaultReplayWaitTime is the long-poll wait of their receives.
	DefaultReplayWaitTime = time.Second
)

// ReplayClient is the part of *sqs.Client a [Replay] uses.
type ReplayClient interface {
	ReceiveMessage(ctx context.Context, in *sqs.ReceiveMessageInput, optFns ...func(*sqs.Options)) (*sqs.ReceiveMessageOutput, error)
	SendMessage(ctx context.Context, in *sqs.SendMessageInput, optFns ...func(*sqs.Options)) (*sqs.SendMessageOutput, error)
	DeleteMessage(ctx context.Context, in *sqs.DeleteMessageInput, optFns ...func(*sqs.Options)) (*sqs.DeleteMessageOutput, error)
	ChangeMessageVisibilityBatch(ctx context.Context, in *sqs.ChangeMessageVisibilityBatchInput, optFns ...func(*sqs.Options)) (*sqs.ChangeMessageVisibilityBatchOutput, error)
	GetQueueAttributes(ctx context.Context, in *sqs.GetQueueAttributesInput, optFns ...func(*sqs.Options)) (*sqs.GetQueueAttributesOutput, error)
	GetQueueUrl(ctx context.Context, in *sqs.GetQueueUrlInput, optFns ...func(*sqs.Options)) (*sqs.GetQueueUrlOutput, error)
}

var _ ReplayClient = (*sqs.Client)(nil)

// Replay lists the dead letters of an SQS dead-letter queue and moves a
// selection of them back to the queues they came from. Create it with
// [NewReplay]. Its methods are safe for concurrent use.
//
// SQS cannot show a message without receiving it. List and Replay receive
// the dead letters with a visibility timeout of WithReplayHold (1 minute)
// and make those they do not delete visible again when they finish, so each
// run adds one to the ApproximateReceiveCount of every dead letter it looked
// at (a dead-letter queue with a redrive policy of its own moves them on
// once that count passes its maxReceiveCount), and the dead letters are out
// of other receivers' sight meanwhile. Only visible dead letters are seen:
// those another receiver holds are left to it.
type Replay struct {
	client ReplayClient
	url    string
	name   string
	attr   string
	hold   time.Duration
	wait   time.Duration

	targets sync.Map // original queue name → replayTarget
	// copied holds the ids of the dead letters whose copy SQS confirmed and
	// whose deletion failed: a later run of this Replay deletes them without
	// a second copy.
	copied sync.Map
}

// replayTarget is a queue dead letters go back to.
type replayTarget struct {
	url  string
	fifo bool
}

// ReplayOption configures a [Replay].
type ReplayOption func(*Replay) error

// WithReplayHold sets the visibility timeout List and Replay receive dead
// letters with, in whole seconds from 1 s to 12 h. Default 1 minute. It
// bounds how long a dead letter stays out of sight when the run that holds
// it stops without giving it back (its process dies), and so how soon a run
// after a crash finds it. Keep it well under five minutes where the dead
// letters go back to FIFO queues: SQS's deduplication, which keeps such a
// crash from duplicating a message, lasts five minutes from the first copy.
// A run holds each batch for at most a third of it (Replay receives fewer
// dead letters at a time when its rate is low).
func WithReplayHold(d time.Duration) ReplayOption {
	return func(r *Replay) error {
		if !wholeSeconds(d, time.Second, MaxLeaseAge) {
			return fmt.Errorf("awssqs.WithReplayHold(%v): must be whole seconds from 1s to 12h", d)
		}
		r.hold = d
		return nil
	}
}

// WithReplayWaitTime sets the long-poll wait of the receives of List and
// Replay, in whole seconds from 0 to 20. Default 1 s: a run ends when a
// receive finds no dead letter it has not seen, and a short poll (0) may
// find none on a queue that has some, since it asks only some of SQS's
// servers. (aws-sdk-go-v2 leaves a zero wait out of the request, so the
// queue's ReceiveMessageWaitTimeSeconds applies then.)
func WithReplayWaitTime(d time.Duration) ReplayOption {
	return func(r *Replay) error {
		if !wholeSeconds(d, 0, 20*time.Second) {
			return fmt.Errorf("awssqs.WithReplayWaitTime(%v): must be whole seconds from 0s to 20s", d)
		}
		r.wait = d
		return nil
	}
}

// WithReplayDiagnosticsAttribute names the attribute the dead letters carry
// their diagnostics in: the name given to the DeadLetter's
// WithDiagnosticsAttribute. Default "custody-diagnostics".
func WithReplayDiagnosticsAttribute(name string) ReplayOption {
	return func(r *Replay) error {
		if !validAttributeName(name) {
			return fmt.Errorf("awssqs.WithReplayDiagnosticsAttribute(%q): not a name SQS allows for a message attribute; pass the name the DeadLetter writes", name)
		}
		r.attr = name
		return nil
	}
}

// NewReplay returns a Replay of the dead-letter queue at dlqURL. It reads
// the queue's attributes once (bounded by ctx), so that a wrong URL,
// region or credentials fail here. A run needs sqs:ReceiveMessage,
// sqs:ChangeMessageVisibility and sqs:DeleteMessage on the dead-letter
// queue, and sqs:GetQueueUrl and sqs:SendMessage on the queues the dead
// letters go back to.
func NewReplay(ctx context.Context, client ReplayClient, dlqURL string, opts ...ReplayOption) (*Replay, error) {
	if client == nil {
		return nil, errors.New("awssqs.NewReplay: nil client; pass an *sqs.Client")
	}
	name, err := queueName(dlqURL)
	if err != nil {
		return nil, fmt.Errorf("awssqs.NewReplay: %w", err)
	}
	r := &Replay{
		client: client,
		url:    dlqURL,
		name:   name,
		attr:   DefaultDiagnosticsAttribute,
		hold:   DefaultReplayHold,
		wait:   DefaultReplayWaitTime,
	}
	if err := option.Apply(r, opts); err != nil {
		return nil, err
	}
	if _, err := client.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{
		QueueUrl:       aws.String(dlqURL),
		AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameFifoQueue},
	}); err != nil {
		return nil, fmt.Errorf("awssqs.NewReplay: reading the attributes of dead-letter queue %s (check the URL, the client's region, endpoint and credentials): %w", dlqURL, err)
	}
	return r, nil
}

// List returns up to max of the queue's visible dead letters with their
// diagnostics (read from the diagnostics attribute; a message SQS's own
// redrive moved there names its original queue only, from its
// DeadLetterQueueSourceArn), and makes them visible again: a dry run, but
// for the receive each costs (see [Replay]). On a FIFO queue they come in
// their groups' order. List stops at max, or when a receive brings no dead
// letter it has not seen. max must be at least 1; each receive brings ten
// at most, and each ten cost a receive and a visibility change.
func (r *Replay) List(ctx context.Context, max int) ([]adapters.DeadLetterRecord, error) {
	if max < 1 {
		return nil, fmt.Errorf("awssqs: Replay.List(max=%d): max must be at least 1", max)
	}
	var (
		out  []adapters.DeadLetterRecord
		seen = map[string]bool{}
		held heldMessages
	)
	defer r.release(ctx, &held)
	for len(out) < max {
		ms, err := r.receive(ctx, min(maxBatch, max-len(out)))
		if err != nil {
			return nil, err
		}
		fresh := false
		for _, m := range ms {
			held.add(m)
			id := aws.ToString(m.MessageId)
			if seen[id] || len(out) == max {
				continue
			}
			seen[id], fresh = true, true
			out = append(out, r.record(m))
		}
		if !fresh {
			break
		}
	}
	return out, nil
}

// Replay moves the visible dead letters o selects, up to o.Max, back to
// their original queues, at most o.Rate a second (10 by default), one at a
// time: for each it sends a copy to the queue named in its
// custody-original-queue diagnostic (or DeadLetterQueueSourceArn), waits for
// SQS to confirm it, then deletes the dead letter. A dead letter whose copy
// cannot be made or sent stays where it is, and so does one whose deletion
// fails; either stops the run with an error, and what it held is made
// visible again.
//
// The copy is the message as it was sent: the dead letter's body and
// attributes (those the DeadLetter packed into the diagnostics for want of
// room come back as String attributes) and X-Ray trace header, without the
// diagnostics attribute, with adapters.HeaderReplayOf set to the dead
// letter's message id, and with o.KeepDiagnostics the diagnostics packed
// into adapters.HeaderReplayDiagnostics. A dead letter whose own attributes
// leave no room for these within SQS's ten stops the run before anything is
// sent. A copy for a FIFO queue goes in the original's MessageGroupId, with
// a deduplication id derived from the dead letter's id. Copies go in the
// order the dead letters come (their groups' order, from a FIFO queue).
//
// Running it again is safe, also after a run that stopped between a
// confirmed copy and its deletion (a failed delete, a crash); what the
// second run does with such a dead letter depends on the queue it goes
// back to:
//
//   - a FIFO queue: the second copy has the first's deduplication id, so SQS
//     drops it, if it comes within five minutes of the first (SQS's
//     deduplication interval). WithReplayHold bounds how long the dead
//     letter stays out of sight after a crash.
//   - a standard queue: SQS does not deduplicate, and nothing short of a
//     transaction across two queues tells a second run that the copy was
//     made, so the message goes back twice. One copy at a time means an
//     interrupted run leaves at most one such duplicate; it carries the
//     same adapters.HeaderReplayOf as the first, for a consumer to drop (an
//     idempotency key that prefers it to the message id). (The SDK's retry
//     of a SendMessage whose answer was lost can store a copy twice too,
//     with the same mark.) This Replay itself remembers the dead letters
//     whose deletion failed, and deletes them without a second copy when it
//     finds them again (counted as Skipped).
//
// On a FIFO dead-letter queue, the dead letters of a group that come after
// one Select leaves out (or one beyond Max) wait for a later run: SQS hands
// out no later message of a group while an earlier one is held. A run ends
// at Max, or when a receive brings no dead letter it has not seen.
func (r *Replay) Replay(ctx context.Context, o adapters.ReplayOptions) (adapters.ReplayResult, error) {
	var res adapters.ReplayResult
	p, err := pace.ForReplay(o.Rate, o.Max)
	if err != nil {
		return res, fmt.Errorf("awssqs: Replay: %w", err)
	}
	// A batch takes (n-1) intervals to copy; keep that within a third of
	// the hold, so the receipt handles stay good.
	batch := maxBatch
	if iv := p.Interval(); iv > 0 {
		batch = int(min(maxBatch, max(1, (r.hold/3)/iv)))
	}
	var (
		judged = map[string]bool{} // dead letters looked at in this run
		held   heldMessages
	)
	defer r.release(ctx, &held)
	for o.Max == 0 || res.Replayed < o.Max {
		// Receive no sooner than a copy may go: a batch's clock starts
		// at its receive.
		if err := p.Ready(ctx); err != nil {
			return res, err
		}
		n := batch
		if o.Max > 0 {
			n = min(n, o.Max-res.Replayed)
		}
		ms, err := r.receive(ctx, n)
		if err != nil {
			return res, err
		}
		received := time.Now()
		fresh := false
		for i, m := range ms {
			id := aws.ToString(m.MessageId)
			if judged[id] {
				held.add(m) // left out earlier in this run, come round again
				continue
			}
			fresh = true
			if o.Max > 0 && res.Replayed >= o.Max {
				held.add(m)
				continue
			}
			judged[id] = true
			if _, copied := r.copied.Load(id); copied {
				if err := r.deleteDeadLetter(ctx, m); err != nil {
					held.addAll(ms[i+1:])
					return res, err
				}
				r.copied.Delete(id)
				res.Skipped++
				continue
			}
			rec := r.record(m)
			if o.Select != nil && !o.Select(rec) {
				held.add(m)
				res.Skipped++
				continue
			}
			if err := p.Wait(ctx); err != nil {
				held.addAll(ms[i:])
				return res, err
			}
			if time.Since(received) > r.hold*2/3 {
				// Too late to trust the receipt handle (a slow SQS): the
				// dead letter comes back into sight when its hold runs out,
				// for a later receive or run.
				delete(judged, id)
				continue
			}
			if err := r.replayOne(ctx, m, rec, o.KeepDiagnostics); err != nil {
				held.addAll(ms[i:])
				return res, err
			}
			res.Replayed++
		}
		if !fresh {
			break
		}
	}
	return res, nil
}

// replayOne copies dead letter m (read as rec) to its original queue, and
// deletes it once SQS has confirmed the copy.
func (r *Replay) replayOne(ctx context.Context, m types.Message, rec adapters.DeadLetterRecord, keep bool) error {
	in, err := r.copyInput(ctx, m, rec, keep)
	if err != nil {
		return err
	}
	if _, err := r.client.SendMessage(ctx, in); err != nil {
		return fmt.Errorf("awssqs: Replay: sending the copy of dead letter %s to %s (the dead letter stays): %w", rec.ID, aws.ToString(in.QueueUrl), err)
	}
	if err := r.deleteDeadLetter(ctx, m); err != nil {
		r.copied.Store(rec.ID, true)
		return fmt.Errorf("%w (its copy is in %s: a later run of this Replay deletes it without a second copy; another run copies it again, which SQS drops if the queue is FIFO and the copies are less than five minutes apart)", err, aws.ToString(in.QueueUrl))
	}
	return nil
}

func (r *Replay) deleteDeadLetter(ctx context.Context, m types.Message) error {
	if _, err := r.client.DeleteMessage(ctx, &sqs.DeleteMessageInput{QueueUrl: aws.String(r.url), ReceiptHandle: m.ReceiptHandle}); err != nil {
		return fmt.Errorf("awssqs: Replay: deleting dead letter %s from %s: %w", aws.ToString(m.MessageId), r.url, err)
	}
	return nil
}

// receive makes one ReceiveMessage call for up to n dead letters, hidden
// for the hold.
func (r *Replay) receive(ctx context.Context, n int) ([]types.Message, error) {
	in := &sqs.ReceiveMessageInput{
		QueueUrl:            aws.String(r.url),
		MaxNumberOfMessages: int32(n),
		VisibilityTimeout:   int32(r.hold / time.Second),
		WaitTimeSeconds:     int32(r.wait / time.Second),
		// Every system attribute (DeadLetterQueueSourceArn, MessageGroupId,
		// AWSTraceHeader, ...), through both fields (see systemAttributes).
		MessageAttributeNames:       []string{"All"},
		AttributeNames:              []types.QueueAttributeName{types.QueueAttributeNameAll},
		MessageSystemAttributeNames: []types.MessageSystemAttributeName{types.MessageSystemAttributeNameAll},
	}
	out, err := r.client.ReceiveMessage(ctx, in)
	if err != nil {
		return nil, fmt.Errorf("awssqs: Replay: receiving from dead-letter queue %s: %w", r.url, err)
	}
	return out.Messages, nil
}

// heldMessages are dead letters a run received and must give back.
type heldMessages struct {
	receipts map[string]string // by message id: the latest receipt handle
	order    []string
}

func (h *heldMessages) add(m types.Message) {
	id := aws.ToString(m.MessageId)
	if h.receipts == nil {
		h.receipts = map[string]string{}
	}
	if _, ok := h.receipts[id]; !ok {
		h.order = append(h.order, id)
	}
	h.receipts[id] = aws.ToString(m.ReceiptHandle)
}

func (h *heldMessages) addAll(ms []types.Message) {
	for _, m := range ms {
		h.add(m)
	}
}

// release makes the held dead letters visible again, in batches of ten. It
// runs even when ctx has ended (bounded by a timeout of its own); a release
// that fails only leaves the dead letters out of sight until the hold runs
// out.
func (r *Replay) release(ctx context.Context, h *heldMessages) {
	if len(h.order) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	for start := 0; start < len(h.order); start += maxBatch {
		ids := h.order[start:min(start+maxBatch, len(h.order))]
		in := &sqs.ChangeMessageVisibilityBatchInput{QueueUrl: aws.String(r.url)}
		for i, id := range ids {
			in.Entries = append(in.Entries, types.ChangeMessageVisibilityBatchRequestEntry{
				Id:            aws.String(fmt.Sprint(i)),
				ReceiptHandle: aws.String(h.receipts[id]),
			})
		}
		_, _ = r.client.ChangeMessageVisibilityBatch(ctx, in)
	}
}

// record reads a received dead letter.
func (r *Replay) record(m types.Message) adapters.DeadLetterRecord {
	rec := adapters.DeadLetterRecord{ID: aws.ToString(m.MessageId)}
	var diag map[string]string // nil if the dead letter carries none
	if v, ok := m.MessageAttributes[r.attr]; ok {
		diag = decodeDiagnostics(attributeString(v))
	}
	// What ReadDeadLetter splits: the attributes as headers, beside the
	// diagnostics proper.
	all := map[string]string{}
	for k, v := range m.MessageAttributes {
		if k != r.attr {
			all[k] = attributeString(v)
		}
	}
	for k, v := range diag {
		if name, ok := strings.CutPrefix(k, diagAttrPrefix); ok {
			if _, live := all[name]; !live && name != "" {
				all[name] = v
			}
			continue
		}
		if adapters.IsDiagnosticHeader(k) {
			all[k] = v
		}
	}
	adapters.ReadDeadLetter(&rec, all)
	// The diagnostics as written: the SQS-specific keys too (original group
	// and deduplication ids, body encoding), but the attributes packed for
	// want of room, which are the message's and now among its headers.
	for k, v := range diag {
		if !strings.HasPrefix(k, diagAttrPrefix) {
			rec.Diagnostics[k] = v
		}
	}
	if rec.OriginalQueue == "" {
		// Moved by SQS's own redrive: the message as it was, with the
		// ARN of the queue it came from.
		if arn := m.Attributes[string(types.MessageSystemAttributeNameDeadLetterQueueSourceArn)]; arn != "" {
			rec.OriginalQueue = arn[strings.LastIndexByte(arn, ':')+1:]
			rec.OriginalID = rec.ID
		}
	}
	switch {
	case rec.Key != "":
		// The original's key, from the diagnostics.
	case len(diag) > 0:
		// Written by a DeadLetter: the original's group, if it had one (the
		// copy's own group in a FIFO dead-letter queue may be a stand-in).
		rec.Key = diag[diagGroupID]
	default:
		// Moved by SQS: the message as it was, in its group.
		rec.Key = m.Attributes[string(types.MessageSystemAttributeNameMessageGroupId)]
	}
	rec.Body = []byte(aws.ToString(m.Body))
	switch diag[diagBodyEncoding] {
	case "base64":
		if b, err := base64.StdEncoding.DecodeString(string(rec.Body)); err == nil {
			rec.Body = b
		}
	case "empty":
		rec.Body = []byte{}
	}
	return rec
}

// copyInput builds the SendMessage input of dead letter m's copy.
func (r *Replay) copyInput(ctx context.Context, m types.Message, rec adapters.DeadLetterRecord, keep bool) (*sqs.SendMessageInput, error) {
	if enc := rec.Diagnostics[diagBodyEncoding]; enc != "" {
		return nil, fmt.Errorf("awssqs: Replay: dead letter %s came from another broker (its body was encoded for SQS: %s=%s); replay it there, or leave it out with ReplayOptions.Select",
			rec.ID, diagBodyEncoding, enc)
	}
	target, err := r.target(ctx, m, rec)
	if err != nil {
		return nil, err
	}
	attrs := nativeAttributes(m)
	for k := range attrs {
		if k == r.attr || adapters.IsDiagnosticHeader(k) || k == adapters.HeaderReplayOf || k == adapters.HeaderReplayDiagnostics {
			delete(attrs, k)
		}
	}
	for k, v := range rec.Headers {
		if _, ok := attrs[k]; ok || k == adapters.HeaderReplayOf || k == adapters.HeaderReplayDiagnostics {
			continue
		}
		// Packed into the diagnostics for want of room: back as text.
		attrs[k] = types.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(v)}
	}
	attrs[adapters.HeaderReplayOf] = types.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(rec.ID)}
	if keep {
		js, err := json.Marshal(rec.Diagnostics)
		if err != nil {
			return nil, fmt.Errorf("awssqs: Replay: packing the diagnostics of dead letter %s: %w", rec.ID, err)
		}
		attrs[adapters.HeaderReplayDiagnostics] = types.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(string(escapeNonCharacters(js)))}
	}
	if len(attrs) > maxAttributes {
		return nil, fmt.Errorf("awssqs: Replay: the copy of dead letter %s would carry %d message attributes (its own and %s%s), over SQS's limit of %d; move it by hand, or leave it out with ReplayOptions.Select",
			rec.ID, len(attrs), adapters.HeaderReplayOf, map[bool]string{true: " and " + adapters.HeaderReplayDiagnostics}[keep], maxAttributes)
	}
	in := &sqs.SendMessageInput{
		QueueUrl:                aws.String(target.url),
		MessageBody:             m.Body,
		MessageAttributes:       attrs,
		MessageSystemAttributes: traceAttribute(m),
	}
	if target.fifo {
		group := rec.Key
		if group == "" {
			group = rec.ID // a group of its own
		}
		in.MessageGroupId = aws.String(group)
		in.MessageDeduplicationId = aws.String(replayDeduplicationID(rec.ID))
	}
	return in, nil
}

// replayDeduplicationID is the MessageDeduplicationId of the copy of dead
// letter id: the same in every run, so that SQS drops a second copy sent
// within five minutes of the first.
func replayDeduplicationID(id string) string {
	sum := sha256.Sum256([]byte("custody-replay\x00" + id))
	return hex.EncodeToString(sum[:])
}

// target resolves the queue dead letter m goes back to: its URL (through
// GetQueueUrl, once per queue) and whether it is FIFO (a name ending in
// .fifo, as SQS requires of FIFO queues).
func (r *Replay) target(ctx context.Context, m types.Message, rec adapters.DeadLetterRecord) (replayTarget, error) {
	name := rec.OriginalQueue
	if name == "" {
		return replayTarget{}, fmt.Errorf("awssqs: Replay: dead letter %s names no original queue (no %s diagnostic, no DeadLetterQueueSourceArn); leave it out with ReplayOptions.Select",
			rec.ID, adapters.HeaderOriginalQueue)
	}
	if t, ok := r.targets.Load(name); ok {
		return t.(replayTarget), nil
	}
	in := &sqs.GetQueueUrlInput{QueueName: aws.String(name)}
	if arn := m.Attributes[string(types.MessageSystemAttributeNameDeadLetterQueueSourceArn)]; arn != "" && rec.Diagnostics[adapters.HeaderOriginalQueue] == "" {
		// arn:aws:sqs:REGION:ACCOUNT:NAME
		if parts := strings.Split(arn, ":"); len(parts) == 6 && parts[4] != "" {
			in.QueueOwnerAWSAccountId = aws.String(parts[4])
		}
	}
	out, err := r.client.GetQueueUrl(ctx, in)
	if err != nil {
		return replayTarget{}, fmt.Errorf("awssqs: Replay: finding the original queue %q of dead letter %s (GetQueueUrl; the queue must exist in the client's account and region; or leave the dead letter out with ReplayOptions.Select): %w",
			name, rec.ID, err)
	}
	t := replayTarget{url: aws.ToString(out.QueueUrl), fifo: strings.HasSuffix(name, ".fifo")}
	r.targets.Store(name, t)
	return t, nil
}
