package awssqs

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/custody-go/custody/adapters"
)

// sums returns the points of the named counter, by the values of the
// attributes named in keys, joined with "/".
func sums(t *testing.T, r *sdkmetric.ManualReader, name string, keys ...string) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			sum, ok := m.Data.(metricdata.Sum[int64])
			if !ok {
				t.Fatalf("%s is a %T, want a counter", name, m.Data)
			}
			for _, p := range sum.DataPoints {
				k := ""
				for i, key := range append([]string{"messaging.destination.name"}, keys...) {
					v, _ := p.Attributes.Value(attribute.Key(key))
					if i > 0 {
						k += "/"
					}
					k += v.Emit()
				}
				got[k] += p.Value
			}
		}
	}
	return got
}

// TestMetrics: the Source counts its requests by operation and result, the
// entries SQS failed by reason, and the messages it received (those it
// released: TestReceiveGivenUpHandsOutNothingAndHidesNothing).
func TestMetrics(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	for i := range 3 {
		e.send(url, fmt.Sprint(i), "", nil)
	}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { mp.Shutdown(context.Background()) })
	src, err := New(e.ctx(), &entryTroubleClient{Client: e.client}, url, testOptions(WithMeterProvider(mp))...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	q := src.name

	ds := receiveAtLeast(t, src, 3)
	// The first delete fails the last entry on SQS's side.
	src.Ack(e.ctx(), ds)
	// A message deleted elsewhere: its renewal is refused as a lost lease.
	if _, err := e.client.DeleteMessage(e.ctx(), &sqs.DeleteMessageInput{QueueUrl: aws.String(url), ReceiptHandle: aws.String(receipt(ds[2]))}); err != nil {
		t.Fatal(err)
	}
	src.Extend(e.ctx(), ds[2:], time.Minute)
	// An empty queue.
	if got, err := src.Receive(e.ctx(), 10); err != nil || len(got) != 0 {
		t.Fatalf("Receive on the emptied queue: %d, %v", len(got), err)
	}
	e.send(url, "more", "", nil)
	ds = receiveAtLeast(t, src, 1)
	src.Nack(e.ctx(), adapters.NackAll(ds, 0))

	requests := sums(t, reader, "custody.sqs.requests", "operation", "result")
	for k, min := range map[string]int64{
		q + "/ReceiveMessage/ok":               2,
		q + "/ReceiveMessage/empty":            1,
		q + "/DeleteMessageBatch/ok":           1,
		q + "/ChangeMessageVisibilityBatch/ok": 2,
	} {
		if requests[k] < min {
			t.Errorf("custody.sqs.requests %s = %d, want at least %d (all: %v)", k, requests[k], min, requests)
		}
	}
	failed := sums(t, reader, "custody.sqs.entries.failed", "operation", "reason")
	want := map[string]int64{q + "/DeleteMessageBatch/sqs": 1, q + "/ChangeMessageVisibilityBatch/lease_lost": 1}
	if fmt.Sprint(failed) != fmt.Sprint(want) {
		t.Errorf("custody.sqs.entries.failed = %v, want %v", failed, want)
	}
	if got := sums(t, reader, "custody.sqs.received"); got[q] != 4 {
		t.Errorf("custody.sqs.received = %v, want 4 for %s", got, q)
	}
}
