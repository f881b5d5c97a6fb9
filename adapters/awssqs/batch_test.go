package awssqs

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/custody-go/custody/adapters"
)

// TestRenewalFailureInASecondBatchNamesItsDelivery: a heartbeat of twelve
// deliveries goes out as two ChangeMessageVisibilityBatch requests, whose
// entry ids restart at "0". SQS refuses the entry of a message deleted
// meanwhile (here by another client) in the second request: Extend must
// report that delivery alone, not the delivery at the same position in the
// first request, whose handler the runtime would then cancel while the gone
// one ran on.
func TestRenewalFailureInASecondBatchNamesItsDelivery(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	for i := range 12 {
		e.send(url, fmt.Sprint("m", i), "", nil)
	}
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ds := receiveAtLeast(t, src, 12)

	const gone = 11 // the second entry of the second request
	if _, err := e.client.DeleteMessage(e.ctx(), &sqs.DeleteMessageInput{QueueUrl: aws.String(url), ReceiptHandle: aws.String(receipt(ds[gone]))}); err != nil {
		t.Fatal(err)
	}
	before := e.counter.Op("ChangeMessageVisibilityBatch")
	err = src.Extend(e.ctx(), ds, 30*time.Second)
	if n := e.counter.Op("ChangeMessageVisibilityBatch") - before; n != 2 {
		t.Errorf("renewing 12 deliveries took %d requests, want 2 (ten entries at most each)", n)
	}
	var be *adapters.BatchError
	if !errors.As(err, &be) || len(be.Failed) != 1 || !errors.Is(be.Failed[gone], adapters.ErrLeaseLost) {
		t.Fatalf("Extend: %v; want a BatchError naming entry %d alone, as a lost lease", err, gone)
	}

	// The others were renewed and are this consumer's to delete.
	kept := append(ds[:gone:gone], ds[gone+1:]...)
	if err := src.Ack(e.ctx(), kept); err != nil {
		t.Fatalf("Ack of the renewed deliveries: %v", err)
	}
	if st := src.Stats(); st.Deleted != int64(len(kept)) || st.LeaseLost != 1 {
		t.Errorf("Stats: Deleted %d, LeaseLost %d; want %d and 1", st.Deleted, st.LeaseLost, len(kept))
	}
}
