package kafka

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kadm"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// TestRecordsDeletedBeforeTheGroupReadThemAreReported: a group falls so far
// behind that retention deletes records past its committed offset. franz-go
// resets the partition to the log start and goes on without a word; those
// records are gone for this group, and the operator must hear of it. Receive
// reports the range with the records after it (the runtime logs the error),
// and custody.kafka.expired counts the records.
func TestRecordsDeletedBeforeTheGroupReadThemAreReported(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 10, 10)
	group := newGroup()
	first := c.open(t, group, "orders", WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	ack(t, first, receiveN(t, first, 3)...)
	commitNow(t, first)
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	// Retention deletes offsets 0 to 6: the committed offset, 3, is gone.
	c.deleteRecords(t, "orders", 7)

	reader, mp := newMeter(t)
	s := c.open(t, group, "orders", WithMeterProvider(mp))
	var got []int64
	var reported error
	rctx, rcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer rcancel()
	for len(got) < 3 {
		ds, err := s.Receive(rctx, 10)
		if err != nil && rctx.Err() == nil && reported == nil {
			reported = err
		}
		if rctx.Err() != nil {
			t.Fatalf("received %v", got)
		}
		got = append(got, offsets(ds)...)
	}
	if got[0] != 7 {
		t.Fatalf("resumed at offset %d, want the log start (7)", got[0])
	}
	if reported == nil || !strings.Contains(reported.Error(), "orders/0") || !strings.Contains(reported.Error(), "3") || !strings.Contains(reported.Error(), "retention") {
		t.Fatalf("Receive reported %v; want an error naming orders/0 and the 4 records from offset 3 deleted by retention", reported)
	}
	expired, _ := collect(t, reader, "custody.kafka.expired").(metricdata.Sum[int64])
	if len(expired.DataPoints) != 1 || expired.DataPoints[0].Value != 4 {
		t.Fatalf("custody.kafka.expired = %+v, want 4 (offsets 3 to 6)", expired)
	}
}

// Records deleted after this assignment polled them were read: retention
// overtaking the committed offset of a partition the Source is working
// through (slow handlers, not a stopped group) is not reported as records
// deleted before the group read them.
func TestRecordsDeletedAfterTheyWerePolledAreNotReported(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 10, 10)
	reader, mp := newMeter(t)
	group := newGroup()
	s := c.open(t, group, "orders", WithCommitInterval(time.Hour), WithCommitLinger(time.Hour), WithOrderingScope(Unordered), WithMeterProvider(mp))
	ds := receiveN(t, s, 10)
	ack(t, s, ds[:3]...)
	commitNow(t, s) // 3; 3..9 still running
	c.deleteRecords(t, "orders", 7)
	c.produceN(t, "orders", 1, 5, 5) // 10..14
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var more []*adapters.Delivery
	for len(more) < 5 {
		got, err := s.Receive(ctx, 5-len(more))
		if err != nil {
			t.Fatalf("Receive after records already polled were deleted: %v", err)
		}
		more = append(more, got...)
	}
	if expired, ok := collect(t, reader, "custody.kafka.expired").(metricdata.Sum[int64]); ok && len(expired.DataPoints) > 0 {
		t.Fatalf("custody.kafka.expired = %+v; every deleted record was read", expired)
	}
}

// deleteRecords deletes the records of topic/0 below offset before, as
// retention does.
func (c *cluster) deleteRecords(t *testing.T, topic string, before int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var upTo kadm.Offsets
	upTo.Add(kadm.Offset{Topic: topic, Partition: 0, At: before})
	deleted, err := c.admin.DeleteRecords(ctx, upTo)
	if err == nil {
		err = deleted.Error()
	}
	if err != nil {
		t.Fatalf("deleting records: %v", err)
	}
}
