package awssqs

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/aws/retry"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/aws/smithy-go"

	"github.com/custody-go/custody/adapters"
)

// batchCall sends one batch request for the deliveries at the given indexes
// (at most ten), with entry ids "0", "1", ... by position in idx, and returns
// the entries that failed. Positional ids matter: after a redelivery the same
// MessageId can appear twice in one batch.
type batchCall func(ctx context.Context, idx []int) ([]types.BatchResultErrorEntry, error)

// runBatches sends ds through call, ten entries per request, the requests
// running concurrently, and returns nil or a *adapters.BatchError naming the
// failed entries. Entries whose skip error is set are not sent and fail with
// that error. When every entry went in one request and that request failed
// whole, it returns the request's error itself.
func (s *Source) runBatches(ctx context.Context, op operation, ds []*adapters.Delivery, skip []error, call batchCall) error {
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
			if err := s.runBatch(ctx, op, ds, idx, call, errs); err != nil && len(idx) == len(ds) {
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
		wg.Go(func() { s.runBatch(ctx, op, ds, chunk, call, errs) })
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

// runBatch sends one request for the entries idx and files the error of
// each entry that failed in errs: one wrapping adapters.ErrLeaseLost when
// SQS no longer takes the receipt handle, an *entryError otherwise. A
// request that fails whole fails every entry with its error, which runBatch
// returns. The request is bounded by the request timeout: the runtime
// waits for Ack, Nack and Extend, with contexts that live as long as the
// consumer.
func (s *Source) runBatch(ctx context.Context, op operation, ds []*adapters.Delivery, idx []int, call batchCall, errs []error) error {
	cctx, cancel := context.WithTimeout(ctx, s.opts.requestTimeout)
	failed, err := call(cctx, idx)
	cancel()
	if err != nil {
		s.tel.request(op, resultError)
		for _, i := range idx {
			errs[i] = err
		}
		return err
	}
	s.tel.request(op, resultOK)
	for _, f := range failed {
		pos, err := strconv.Atoi(aws.ToString(f.Id))
		if err != nil || pos < 0 || pos >= len(idx) {
			continue // not an id we sent; SQS never does this
		}
		i := idx[pos]
		switch {
		case receiptInvalid(f):
			s.stats.leaseLost.Add(1)
			s.tel.entryFailed(op, reasonLeaseLost)
			errs[i] = fmt.Errorf("%w (SQS: %s: %s)", adapters.ErrLeaseLost, aws.ToString(f.Code), aws.ToString(f.Message))
			continue
		case f.SenderFault:
			s.tel.entryFailed(op, reasonRefused)
		default:
			s.tel.entryFailed(op, reasonSQS)
		}
		errs[i] = &entryError{id: ds[i].ID, code: aws.ToString(f.Code), message: aws.ToString(f.Message), senderFault: f.SenderFault}
	}
	return nil
}

// entryError is a batch entry SQS failed, for a reason other than its
// receipt handle.
type entryError struct {
	id, code, message string
	senderFault       bool
}

func (e *entryError) Error() string {
	side := "refused"
	if !e.senderFault {
		side = "failed on its side"
	}
	return fmt.Sprintf("awssqs: SQS %s the entry for message %s: %s: %s", side, e.id, e.code, e.message)
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

// retryables are the SDK's own rules for a request worth sending again:
// connection errors, throttling, server errors, request timeouts.
var retryables = retry.IsErrorRetryables(retry.DefaultRetryables)

// IsRetryable reports whether an Ack or Nack entry that failed with err may
// succeed if sent again (adapters.Retryable): SQS failed the entry on its
// side, or the request failed whole for a passing reason (the network,
// throttling, a server error, the request timeout). The runtime then sends
// the entry again. An entry SQS refused as the sender's fault, a request
// refused as malformed or forbidden, and a call cut by Close are final.
func (s *Source) IsRetryable(err error) bool {
	var ee *entryError
	switch {
	case errors.As(err, &ee):
		return !ee.senderFault
	case errors.Is(err, adapters.ErrLeaseLost), errors.Is(err, adapters.ErrClosed), errors.Is(err, context.Canceled):
		return false
	case errors.Is(err, context.DeadlineExceeded):
		return true
	}
	switch retryables.IsErrorRetryable(err) {
	case aws.TrueTernary:
		return true
	case aws.FalseTernary:
		return false
	}
	var ae smithy.APIError
	if errors.As(err, &ae) {
		return ae.ErrorFault() == smithy.FaultServer
	}
	// Not an answer from SQS: the request did not complete.
	return true
}
