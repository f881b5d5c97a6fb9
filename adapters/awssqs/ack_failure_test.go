package awssqs

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/aws/smithy-go"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// failingDeleteClient fails every DeleteMessageBatch call as a network error
// would.
type failingDeleteClient struct{ *sqs.Client }

func (c *failingDeleteClient) DeleteMessageBatch(ctx context.Context, in *sqs.DeleteMessageBatchInput, o ...func(*sqs.Options)) (*sqs.DeleteMessageBatchOutput, error) {
	return nil, errors.New("connection reset by peer")
}

// TestWholeAckRequestFailureIsNotABatchError: when the whole delete request
// failed, Ack says so with the request's error, not a BatchError naming
// every entry, and IsRetryable tells the runtime to send it again (a
// message acked but not deleted after a mere network blip would come back
// as a duplicate).
func TestWholeAckRequestFailureIsNotABatchError(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	e.send(url, "m", "", nil)
	src, err := New(e.ctx(), &failingDeleteClient{Client: e.client}, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ds := receiveAtLeast(t, src, 1)
	err = src.Ack(e.ctx(), ds)
	if err == nil {
		t.Fatal("Ack succeeded although DeleteMessageBatch failed")
	}
	var be *adapters.BatchError
	if errors.As(err, &be) {
		t.Fatalf("Ack returned a BatchError (%v) for a failed request", err)
	}
	if !src.IsRetryable(err) {
		t.Errorf("IsRetryable(%v) = false; the runtime would not send the request again", err)
	}
}

// entryTroubleClient answers the first DeleteMessageBatch as SQS does when it
// fails one entry on its side: it deletes the other entries and reports the
// last one failed with an InternalError (not the sender's fault). Later
// calls go through.
type entryTroubleClient struct {
	*sqs.Client
	calls atomic.Int32
}

func (c *entryTroubleClient) DeleteMessageBatch(ctx context.Context, in *sqs.DeleteMessageBatchInput, o ...func(*sqs.Options)) (*sqs.DeleteMessageBatchOutput, error) {
	if c.calls.Add(1) != 1 {
		return c.Client.DeleteMessageBatch(ctx, in, o...)
	}
	last := in.Entries[len(in.Entries)-1]
	cp := *in
	cp.Entries = in.Entries[:len(in.Entries)-1]
	out, err := c.Client.DeleteMessageBatch(ctx, &cp, o...)
	if err != nil {
		return nil, err
	}
	out.Failed = append(out.Failed, types.BatchResultErrorEntry{
		Id: last.Id, Code: aws.String("InternalError"), Message: aws.String("We encountered an internal error. Please try again."),
	})
	return out, nil
}

// TestAckReportsAnEntrySQSFailed: one entry of a delete batch fails on SQS's
// side and the others are deleted. Ack makes one request and reports that
// entry alone, as one worth sending again: retrying is the runtime's job,
// not the adapter's.
func TestAckReportsAnEntrySQSFailed(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	for i := range 3 {
		e.send(url, fmt.Sprint("m", i), "", nil)
	}
	src, err := New(e.ctx(), &entryTroubleClient{Client: e.client}, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ds := receiveAtLeast(t, src, 3)
	before := e.counter.Op("DeleteMessageBatch")
	err = src.Ack(e.ctx(), ds)
	if n := e.counter.Op("DeleteMessageBatch") - before; n != 1 {
		t.Errorf("Ack made %d DeleteMessageBatch requests, want 1: the runtime retries, not the adapter", n)
	}
	var be *adapters.BatchError
	if !errors.As(err, &be) || len(be.Failed) != 1 || be.Failed[2] == nil {
		t.Fatalf("Ack: %v; want a BatchError naming entry 2 alone", err)
	}
	if !src.IsRetryable(be.Failed[2]) {
		t.Errorf("IsRetryable(%v) = false for an entry SQS failed on its side", be.Failed[2])
	}
	if errors.Is(be.Failed[2], adapters.ErrLeaseLost) {
		t.Errorf("entry failed on SQS's side reported as a lost lease: %v", be.Failed[2])
	}
	if st := src.Stats(); st.Deleted != 2 || st.LeaseLost != 0 {
		t.Errorf("Stats: Deleted %d, LeaseLost %d; want 2 deleted, none lost", st.Deleted, st.LeaseLost)
	}
}

// TestRuntimeRetriesAnEntrySQSFailed: the runtime sends again the entry SQS
// failed on its side, so every message is deleted once, handled once.
// Without IsRetryable the runtime would leave it, and the message would
// come back after its visibility timeout to be handled again.
func TestRuntimeRetriesAnEntrySQSFailed(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	const n = 3
	for i := range n {
		e.send(url, fmt.Sprint("m", i), "", nil)
	}
	src, err := New(e.ctx(), &entryTroubleClient{Client: e.client}, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	var handled atomic.Int32
	// Run stops once every message was handled; it returns after the acks
	// of the drain, retries included.
	runUntil(t, src, consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		handled.Add(1)
		return nil
	}), "every message handled", func() bool { return handled.Load() >= n })
	if st := src.Stats(); st.Deleted != n || st.LeaseLost != 0 {
		t.Errorf("Stats: Deleted %d, LeaseLost %d; want all %d deleted, the failed entry sent again", st.Deleted, st.LeaseLost, n)
	}
	if got := handled.Load(); got != n {
		t.Errorf("%d handler calls for %d messages", got, n)
	}
}

func TestIsRetryable(t *testing.T) {
	src := &Source{}
	for _, c := range []struct {
		err  error
		want bool
	}{
		{&entryError{code: "InternalError"}, true},
		{fmt.Errorf("wrapped: %w", &entryError{code: "InternalError"}), true},
		{&entryError{code: "InvalidParameterValue", senderFault: true}, false},
		{fmt.Errorf("%w (SQS: ReceiptHandleIsInvalid)", adapters.ErrLeaseLost), false},
		{ErrMaxVisibility, false},
		{adapters.ErrClosed, false},
		{fmt.Errorf("awssqs: DeleteMessageBatch: %w", context.Canceled), false},
		{fmt.Errorf("awssqs: DeleteMessageBatch: %w", context.DeadlineExceeded), true},
		{&smithy.GenericAPIError{Code: "RequestThrottled", Message: "slow down"}, true},
		{&smithy.GenericAPIError{Code: "InternalFailure", Fault: smithy.FaultServer}, true},
		{&smithy.GenericAPIError{Code: "AccessDenied", Fault: smithy.FaultClient}, false},
		{&types.QueueDoesNotExist{}, false},
		{&net.OpError{Op: "read", Err: errors.New("connection reset by peer")}, true},
		{errors.New("connection reset by peer"), true},
	} {
		if got := src.IsRetryable(c.err); got != c.want {
			t.Errorf("IsRetryable(%T %v) = %v, want %v", c.err, c.err, got, c.want)
		}
	}
}
