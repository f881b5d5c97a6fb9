package awssqs

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
)

// Ack deletes the messages with DeleteMessageBatch, ten per request, the
// requests running concurrently. The runtime already gathers acks into
// batches of ten (Capabilities.Ack), so Ack
// sends what it is given without waiting. An entry whose receipt handle SQS
// rejects is marked lost (adapters.ErrLeaseLost) and counted; its message was
// already redelivered or deleted.
func (s *Source) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	err := s.runBatches(ctx, ds, nil, func(ctx context.Context, idx []int) ([]types.BatchResultErrorEntry, error) {
		entries := make([]types.DeleteMessageBatchRequestEntry, len(idx))
		for pos, i := range idx {
			entries[pos] = types.DeleteMessageBatchRequestEntry{
				Id:            aws.String(strconv.Itoa(pos)),
				ReceiptHandle: aws.String(receipt(ds[i])),
			}
		}
		s.stats.deleteRequests.Add(1)
		out, err := s.client.DeleteMessageBatch(ctx, &sqs.DeleteMessageBatchInput{QueueUrl: aws.String(s.url), Entries: entries})
		if err != nil {
			return nil, fmt.Errorf("awssqs: DeleteMessageBatch: %w", err)
		}
		s.stats.deleted.Add(int64(len(out.Successful)))
		return out.Failed, nil
	})
	return err
}

// Extend renews the visibility timeout of each delivery to d from now, with
// ChangeMessageVisibilityBatch, ten per request. The runtime's lease keeper
// already batches renewals (Capabilities.Extend), so Extend does not
// linger. A renewal is cut to what is left of SQS's 12 hours since the
// receive; a delivery with less than a second left is marked lost instead.
func (s *Source) Extend(ctx context.Context, ds []*adapters.Delivery, d time.Duration) error {
	now := time.Now()
	secs := make([]int32, len(ds))
	skip := make([]error, len(ds))
	for i, dl := range ds {
		secs[i], skip[i] = capTimeout(dl, d, now)
	}
	// A message given back to the redrive policy is not renewed: landing
	// after the release, a renewal would hide it for a whole timeout again
	// (see Redrive.Send, which waits for those already on the wire).
	var renewing []*handle
	s.mu.Lock()
	for i, dl := range ds {
		if h, ok := dl.Handle.(*handle); ok && skip[i] == nil {
			if h.handedBack {
				skip[i] = errHandedBack
				continue
			}
			h.renewing++
			renewing = append(renewing, h)
		}
	}
	s.mu.Unlock()
	err := s.changeVisibility(ctx, ds, secs, skip)
	s.mu.Lock()
	for _, h := range renewing {
		if h.renewing--; h.renewing == 0 && h.renewed != nil {
			close(h.renewed)
			h.renewed = nil
		}
	}
	s.mu.Unlock()
	return withoutHandedBack(err)
}

// errHandedBack marks the renewals Extend leaves out because the message was
// given back to the redrive policy; they are reported as done.
var errHandedBack = errors.New("awssqs: the message was given back to the redrive policy")

// withoutHandedBack drops the entries failed with errHandedBack from err.
func withoutHandedBack(err error) error {
	var be *adapters.BatchError
	if !errors.As(err, &be) {
		return err
	}
	for i, e := range be.Failed {
		if errors.Is(e, errHandedBack) {
			delete(be.Failed, i)
		}
	}
	if len(be.Failed) == 0 {
		return nil
	}
	return err
}

// Nack makes each message visible again after its entry's delay (rounded up to
// whole seconds, at most what is left of the 12 hours since the receive), so
// retries wait in SQS rather than in this process. Nacks from concurrent
// callers share ChangeMessageVisibilityBatch requests: each waits up to
// WithNackLinger for others to fill a batch.
func (s *Source) Nack(ctx context.Context, ns []adapters.Nack) error {
	if len(ns) == 0 {
		return nil
	}
	return s.nacks.submit(ctx, ns)
}

// changeVisibility sets the visibility timeout of ds[i] to secs[i] seconds
// with ChangeMessageVisibilityBatch requests. Entries with a skip error, and
// deliveries already lost, are not sent and fail with that error or the
// cause of the loss; skip may be nil.
func (s *Source) changeVisibility(ctx context.Context, ds []*adapters.Delivery, secs []int32, skip []error) error {
	// A lost delivery's receipt handle may be stale: its message may be in
	// flight with another consumer under a newer handle. SQS may accept the
	// stale handle without effect, so that a renewal seems to hold what is
	// gone, and the emulator even applies it to the new receive, hiding or
	// releasing another consumer's message. Such entries fail with the
	// cause of the loss and are not sent.
	for i, d := range ds {
		if cause := d.Signal.LostCause(); cause != nil && (skip == nil || skip[i] == nil) {
			if skip == nil {
				skip = make([]error, len(ds))
			}
			skip[i] = cause
		}
	}
	return s.runBatches(ctx, ds, skip, func(ctx context.Context, idx []int) ([]types.BatchResultErrorEntry, error) {
		entries := make([]types.ChangeMessageVisibilityBatchRequestEntry, len(idx))
		for pos, i := range idx {
			entries[pos] = types.ChangeMessageVisibilityBatchRequestEntry{
				Id:                aws.String(strconv.Itoa(pos)),
				ReceiptHandle:     aws.String(receipt(ds[i])),
				VisibilityTimeout: secs[i],
			}
		}
		s.stats.visibilityRequests.Add(1)
		out, err := s.client.ChangeMessageVisibilityBatch(ctx, &sqs.ChangeMessageVisibilityBatchInput{QueueUrl: aws.String(s.url), Entries: entries})
		if err != nil {
			return nil, fmt.Errorf("awssqs: ChangeMessageVisibilityBatch: %w", err)
		}
		s.stats.visibilityChanged.Add(int64(len(out.Successful)))
		return out.Failed, nil
	})
}

// ErrMaxVisibility is the cause (wrapping adapters.ErrLeaseLost) given to a
// delivery held for SQS's 12 hours: its visibility cannot be extended further.
var ErrMaxVisibility = fmt.Errorf("%w: SQS keeps a received message invisible for at most 12 hours", adapters.ErrLeaseLost)

// capTimeout rounds want up to whole seconds and cuts it to what is left of
// the 12 hours since d was received: SQS rejects a change beyond that. The
// 12 hours are counted from when the ReceiveMessage call was made, since SQS
// starts them at its receive, before the answer arrives (ReceivedAt). A
// delivery with less than a second left fails with ErrMaxVisibility.
func capTimeout(d *adapters.Delivery, want time.Duration, now time.Time) (int32, error) {
	secs, ok := cappedSeconds(d, want, now)
	if !ok {
		return 0, ErrMaxVisibility
	}
	return secs, nil
}

// nackTimeout is capTimeout for nacks: a message at the end of its 12 hours
// is made visible at once rather than lost.
func nackTimeout(d *adapters.Delivery, want time.Duration, now time.Time) int32 {
	secs, ok := cappedSeconds(d, want, now)
	if !ok {
		return 0
	}
	return secs
}

func cappedSeconds(d *adapters.Delivery, want time.Duration, now time.Time) (int32, bool) {
	secs := max(int64(math.Ceil(want.Seconds())), 0)
	start := d.ReceivedAt
	if h, ok := d.Handle.(*handle); ok && !h.asked.IsZero() {
		start = h.asked
	}
	if !start.IsZero() {
		left := int64((MaxLeaseAge - now.Sub(start)) / time.Second)
		if left < 1 {
			return 0, false
		}
		secs = min(secs, left)
	}
	return int32(secs), true
}
