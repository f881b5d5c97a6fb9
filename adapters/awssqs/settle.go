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

// Ack deletes the messages, one DeleteMessageBatch request per ten entries.
// Entries fail alone and requests whole (see the package documentation,
// section Leases).
//
// A delivery NativeDeadLetter gave back to the redrive policy is not
// deleted, and its entry succeeds: the policy must find the message, and
// the ack only completes the dead-lettering (the runtime may not know the
// sink settled the original, if a wrapper hides adapters.OriginalSettler).
func (s *Source) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	if sent, idx := s.notHandedBack(ds); len(sent) < len(ds) {
		return remapEntries(s.Ack(ctx, sent), idx)
	}
	return s.runBatches(ctx, opDelete, ds, nil, func(ctx context.Context, idx []int) ([]types.BatchResultErrorEntry, error) {
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
}

// Extend renews the visibility timeout of each delivery to d from now, one
// ChangeMessageVisibilityBatch request per ten entries. A renewal is cut to
// what is left of SQS's 12 hours since the receive; an entry with less than
// a second left fails with ErrMaxVisibility, unsent.
func (s *Source) Extend(ctx context.Context, ds []*adapters.Delivery, d time.Duration) error {
	now := time.Now()
	secs := make([]int32, len(ds))
	skip := make([]error, len(ds))
	for i, dl := range ds {
		secs[i], skip[i] = capTimeout(dl, d, now)
	}
	// A renewal landing after NativeDeadLetter.Send's release would hide the
	// message for a whole timeout again: it is not sent, and Send waits for
	// those already on the wire.
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
	return dropHandedBack(err)
}

// errHandedBack marks the renewals Extend leaves out because the message was
// given back to the redrive policy; they are reported as done.
var errHandedBack = errors.New("awssqs: the message was given back to the redrive policy")

// dropHandedBack drops the entries failed with errHandedBack from err.
func dropHandedBack(err error) error {
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

// Nack makes each message visible again after its entry's delay (rounded
// up to whole seconds, at most what is left of the 12 hours since the
// receive), so retries wait in SQS: one ChangeMessageVisibilityBatch request
// per ten entries. Entries fail as Ack's do.
func (s *Source) Nack(ctx context.Context, ns []adapters.Nack) error {
	if len(ns) == 0 {
		return nil
	}
	now := time.Now()
	ds := make([]*adapters.Delivery, len(ns))
	secs := make([]int32, len(ns))
	for i, n := range ns {
		// A message at the end of its 12 hours is made visible at once
		// (0 s) rather than lost.
		ds[i] = n.Delivery
		secs[i], _ = capTimeout(n.Delivery, n.After, now)
	}
	return s.changeVisibility(ctx, ds, secs, nil)
}

// changeVisibility sets the visibility timeout of ds[i] to secs[i] seconds
// with ChangeMessageVisibilityBatch requests. Entries with a skip error
// (skip may be nil), and deliveries already lost, are not sent and fail with
// that error or the cause of the loss: a lost delivery's receipt handle may
// be stale, and SQS may accept a stale handle without effect (the emulator
// even applies it to the newer receive, another consumer's).
func (s *Source) changeVisibility(ctx context.Context, ds []*adapters.Delivery, secs []int32, skip []error) error {
	for i, d := range ds {
		if cause := d.Signal.LostCause(); cause != nil && (skip == nil || skip[i] == nil) {
			if skip == nil {
				skip = make([]error, len(ds))
			}
			skip[i] = cause
		}
	}
	return s.runBatches(ctx, opVisibility, ds, skip, func(ctx context.Context, idx []int) ([]types.BatchResultErrorEntry, error) {
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
// the 12 hours since d's ReceiveMessage call was made (SQS starts them at
// its receive, before the answer sets ReceivedAt) and rejects a change
// beyond them. A delivery with less than a second left gets 0 and
// ErrMaxVisibility.
func capTimeout(d *adapters.Delivery, want time.Duration, now time.Time) (int32, error) {
	secs := max(int64(math.Ceil(want.Seconds())), 0)
	start := d.ReceivedAt
	if h, ok := d.Handle.(*handle); ok && !h.asked.IsZero() {
		start = h.asked
	}
	if !start.IsZero() {
		left := int64((MaxLeaseAge - now.Sub(start)) / time.Second)
		if left < 1 {
			return 0, ErrMaxVisibility
		}
		secs = min(secs, left)
	}
	return int32(secs), nil
}

// notHandedBack returns the deliveries of ds that were not given back to
// the redrive policy, and their indexes in ds.
func (s *Source) notHandedBack(ds []*adapters.Delivery) (sent []*adapters.Delivery, idx []int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, d := range ds {
		if h, ok := d.Handle.(*handle); !ok || !h.handedBack {
			sent = append(sent, d)
			idx = append(idx, i)
		}
	}
	return sent, idx
}

// remapEntries renumbers the failed entries of a call made for some of a
// call's deliveries to their indexes idx in the whole call.
func remapEntries(err error, idx []int) error {
	var be *adapters.BatchError
	if !errors.As(err, &be) {
		return err
	}
	failed := make(map[int]error, len(be.Failed))
	for i, e := range be.Failed {
		failed[idx[i]] = e
	}
	return &adapters.BatchError{Failed: failed}
}
