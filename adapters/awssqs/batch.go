package awssqs

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
)

// batchCall sends one batch request for the deliveries at the given indexes
// (at most ten), with entry ids "0", "1", ... by position in idx, and returns
// the entries that failed. Positional ids matter: after a redelivery the same
// MessageId can appear twice in one batch.
type batchCall func(ctx context.Context, idx []int) ([]types.BatchResultErrorEntry, error)

// runBatches splits ds into batches of ten, runs them concurrently through
// call and returns nil or a *adapters.BatchError naming the failed entries.
// Entries whose skip error is set are not sent and fail with that error.
func (s *Source) runBatches(ctx context.Context, ds []*adapters.Delivery, skip []error, call batchCall) error {
	errs := make([]error, len(ds))
	copy(errs, skip)
	var idx []int
	for i := range ds {
		if errs[i] == nil {
			idx = append(idx, i)
		}
	}
	if len(idx) <= maxBatch {
		if len(idx) > 0 {
			if err := s.runBatch(ctx, ds, idx, call, errs); err != nil && len(idx) == len(ds) {
				// The whole request failed (network, throttling, bad
				// credentials): say so plainly, so the caller may retry it.
				return err
			}
		}
		return batchResult(errs)
	}
	var wg sync.WaitGroup
	for len(idx) > 0 {
		n := min(len(idx), maxBatch)
		chunk := idx[:n:n]
		idx = idx[n:]
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.runBatch(ctx, ds, chunk, call, errs)
		}()
	}
	wg.Wait()
	return batchResult(errs)
}

func batchResult(errs []error) error {
	failed := map[int]error{}
	for i, err := range errs {
		if err != nil {
			failed[i] = err
		}
	}
	if len(failed) == 0 {
		return nil
	}
	return &adapters.BatchError{Failed: failed}
}

// runBatch sends one batch and handles its failed entries: an invalid or
// expired receipt handle means the lease was lost (the delivery is marked
// lost, counted, and will come back); a failure on SQS's side is retried for
// that entry alone, a few times with a short backoff; anything else is
// reported for that entry. Each request has its own timeout
// (requestTimeout).
// It returns the error of the whole request when the first request itself
// failed; a retry failing whole is retried in turn, then fails its entries
// alone.
func (s *Source) runBatch(ctx context.Context, ds []*adapters.Delivery, idx []int, call batchCall, errs []error) error {
	backoff := s.opts.entryRetryBackoff
	for try := 0; ; try++ {
		// Each request is bounded here: the runtime waits for Ack (and acks
		// with a context that lives as long as the consumer), so a request
		// SQS never answers must not hold it, nor shutdown, for ever.
		cctx, cancel := context.WithTimeout(ctx, s.opts.requestTimeout)
		failed, err := call(cctx, idx)
		cancel()
		if err != nil && (try == 0 || try >= s.opts.entryRetries) {
			for _, i := range idx {
				errs[i] = err
			}
			if try > 0 {
				// The first request settled the other entries (deleted,
				// renewed or refused). A plain error would tell the caller
				// that none was, and it would send them all again: SQS
				// refuses the handles of messages it deleted, so they
				// would be reported lost although they were acked.
				return nil
			}
			return err
		}
		var retry []int
		if err != nil {
			// A retry failing whole fails the entries it carried on
			// SQS's side or on the way: they are tried again alone.
			retry = idx
		}
		for _, f := range failed {
			pos, err := strconv.Atoi(aws.ToString(f.Id))
			if err != nil || pos < 0 || pos >= len(idx) {
				continue // not an id we sent; SQS never does this
			}
			i := idx[pos]
			switch {
			case receiptInvalid(f):
				lost := fmt.Errorf("%w (SQS: %s: %s)", adapters.ErrLeaseLost, aws.ToString(f.Code), aws.ToString(f.Message))
				s.stats.leaseLost.Add(1)
				ds[i].Signal.Lose(lost)
				errs[i] = lost
			case !f.SenderFault && try < s.opts.entryRetries:
				retry = append(retry, i)
			default:
				errs[i] = fmt.Errorf("awssqs: SQS refused the entry for message %s: %s: %s", ds[i].ID, aws.ToString(f.Code), aws.ToString(f.Message))
			}
		}
		if len(retry) == 0 {
			return nil
		}
		s.stats.entryRetries.Add(int64(len(retry)))
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			for _, i := range retry {
				errs[i] = fmt.Errorf("awssqs: retrying a failed batch entry: %w", ctx.Err())
			}
			return nil
		}
		backoff *= 2
		idx = retry
	}
}

// receiptInvalid reports whether a failed entry says the receipt handle no
// longer names an in-flight message: the visibility timeout ran out (and the
// message may be with another consumer) or the message is gone.
func receiptInvalid(f types.BatchResultErrorEntry) bool {
	code := aws.ToString(f.Code)
	switch {
	case strings.Contains(code, "ReceiptHandleIsInvalid"),
		strings.Contains(code, "InvalidReceiptHandle"),
		strings.Contains(code, "MessageNotInflight"):
		return true
	case code == "InvalidParameterValue":
		msg := strings.ToLower(aws.ToString(f.Message))
		return strings.Contains(msg, "receipthandle") || strings.Contains(msg, "receipt handle")
	}
	return false
}
