package awssqs

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
)

// failingDeleteClient fails every DeleteMessageBatch call as a network error
// would.
type failingDeleteClient struct{ *sqs.Client }

func (c *failingDeleteClient) DeleteMessageBatch(ctx context.Context, in *sqs.DeleteMessageBatchInput, o ...func(*sqs.Options)) (*sqs.DeleteMessageBatchOutput, error) {
	return nil, errors.New("connection reset by peer")
}

// TestWholeAckRequestFailureIsNotABatchError: when the whole delete request
// failed, Ack says so with a plain error, not a BatchError: the runtime
// retries a plain error, while a BatchError means "these entries were
// refused" and is not retried (the message would come back as a duplicate
// after a mere network blip).
func TestWholeAckRequestFailureIsNotABatchError(t *testing.T) {
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	e.send(url, "m", "", nil)
	src, err := New(e.ctx(), &failingDeleteClient{Client: e.client}, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	var ds []*adapters.Delivery
	for len(ds) == 0 {
		got, err := src.Receive(e.ctx(), 1)
		if err != nil {
			t.Fatal(err)
		}
		ds = append(ds, got...)
	}
	err = src.Ack(e.ctx(), ds)
	if err == nil {
		t.Fatal("Ack succeeded although DeleteMessageBatch failed")
	}
	var be *adapters.BatchError
	if errors.As(err, &be) {
		t.Fatalf("Ack returned a BatchError (%v) for a failed request; the runtime would not retry it", err)
	}
}

// entryTroubleClient answers the first DeleteMessageBatch as SQS does when it
// fails one entry on its side: it deletes the other entries and reports the
// last one failed with an InternalError (not the sender's fault). The next
// outages calls fail whole, as a dropped connection or throttling would;
// later calls go through.
type entryTroubleClient struct {
	*sqs.Client
	outages int
	calls   atomic.Int32
}

func (c *entryTroubleClient) DeleteMessageBatch(ctx context.Context, in *sqs.DeleteMessageBatchInput, o ...func(*sqs.Options)) (*sqs.DeleteMessageBatchOutput, error) {
	switch call := int(c.calls.Add(1)); {
	case call == 1:
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
	case call <= 1+c.outages:
		return nil, errors.New("connection reset by peer")
	}
	return c.Client.DeleteMessageBatch(ctx, in, o...)
}

// TestEntryRetryFailingWholeKeepsTheOtherEntries: one entry of a delete
// batch fails on SQS's side, the others are deleted, and the request that
// retries that entry alone fails whole. Ack must not answer with a plain
// error: the runtime takes a plain error to mean that no entry was deleted
// and sends the whole batch again, and SQS refuses the handles of the
// messages it already deleted, so they are reported lost and "expect a
// redelivery" although they were acked. The failing entry is retried a few
// times, like any entry failing on SQS's side, and only it fails if SQS
// stays down.
func TestEntryRetryFailingWholeKeepsTheOtherEntries(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name    string
		outages int
	}{
		{"retry succeeds", 1},
		{"SQS stays down", 1000},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			url, _ := e.queue(false, 30*time.Second, nil)
			for i := range 3 {
				e.send(url, fmt.Sprint("m", i), "", nil)
			}
			client := &entryTroubleClient{Client: e.client, outages: c.outages}
			src, err := New(e.ctx(), client, url, testOptions()...)
			if err != nil {
				t.Fatal(err)
			}
			defer src.Close()
			ds := receiveAtLeast(t, src, 3)
			err = src.Ack(e.ctx(), ds)
			var be *adapters.BatchError
			switch {
			case c.outages == 1 && err != nil:
				t.Fatalf("Ack: %v; want nil, the failed entry deleted on a later try", err)
			case c.outages > 1 && !errors.As(err, &be):
				t.Fatalf("Ack: %v; want a BatchError naming the entry SQS failed alone: the runtime would delete the others again", err)
			case c.outages > 1 && (len(be.Failed) != 1 || be.Failed[2] == nil):
				t.Fatalf("Ack failed entries %v; want entry 2 alone", be.Failed)
			}
			for i, d := range ds[:2] {
				if cause := d.Signal.LostCause(); cause != nil {
					t.Errorf("delivery %d, deleted by the first request, was marked lost: %v", i, cause)
				}
			}
			want := int64(3)
			if c.outages > 1 {
				want = 2
			}
			if st := src.Stats(); st.Deleted != want || st.LeaseLost != 0 {
				t.Errorf("Stats: Deleted %d, LeaseLost %d; want %d deleted, none lost", st.Deleted, st.LeaseLost, want)
			}
		})
	}
}
