package jetstream

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// backlogGauges returns the runtime's custody.backlog.* gauges as reader
// collects them; oldest is -1 when not reported.
func backlogGauges(t *testing.T, reader *sdkmetric.ManualReader) (waiting, inFlight int64, oldest float64) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	waiting, inFlight, oldest = -1, -1, -1
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch g := m.Data.(type) {
			case metricdata.Gauge[int64]:
				if len(g.DataPoints) == 1 && m.Name == "custody.backlog.waiting" {
					waiting = g.DataPoints[0].Value
				}
				if len(g.DataPoints) == 1 && m.Name == "custody.backlog.in_flight" {
					inFlight = g.DataPoints[0].Value
				}
			case metricdata.Gauge[float64]:
				if len(g.DataPoints) == 1 && m.Name == "custody.backlog.oldest_age" {
					oldest = g.DataPoints[0].Value
				}
			}
		}
	}
	return waiting, inFlight, oldest
}

// TestBacklogMatchesTheConsumerInfo holds two of seven messages in
// handlers that wait: the runtime's Status().Backlog and its
// custody.backlog.* gauges must show the server's own counts (five
// pending, two ack-pending), and the oldest waiting message's age must be
// that of the third message, the next the consumer delivers.
func TestBacklogMatchesTheConsumerInfo(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	name := uniqueName(t)
	e.stream(name, false)
	// Pauses between the publishes set the messages' timestamps apart, so
	// that the age of another message than the third would fall outside
	// the bounds below.
	for i := range 7 {
		if i == 2 || i == 3 {
			time.Sleep(100 * time.Millisecond)
		}
		e.publish(name+".m", []byte(fmt.Sprint("m", i+1)), nil)
	}
	st, err := e.js.Stream(e.ctx(), name)
	if err != nil {
		t.Fatal(err)
	}
	third, err := st.GetMsg(e.ctx(), 3)
	if err != nil {
		t.Fatal(err)
	}
	src, err := New(e.ctx(), e.js, name, "backlog", WithCreate(jetstream.ConsumerConfig{AckWait: 30 * time.Second}),
		WithPollWait(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	release := make(chan struct{})
	started := make(chan struct{}, 7)
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		started <- struct{}{}
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}), consumer.WithLogger(testlog.New(t)), consumer.WithConcurrency(2), consumer.WithMaxInFlight(2),
		consumer.WithMeterProvider(mp), consumer.WithBacklogInterval(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() { cancel(); <-done }()
	<-started
	<-started
	// A poll under way when the handlers started may have counted before
	// the fetch: wait for the one after it.
	held := time.Now()
	waitFor(t, "a backlog poll ending after two messages were held", func() bool { return c.Status().BacklogAt.After(held) })
	polled := c.Status().BacklogAt
	waitFor(t, "the next backlog poll", func() bool { return c.Status().BacklogAt.After(polled) })

	ci, err := src.cons.Info(e.ctx())
	if err != nil {
		t.Fatal(err)
	}
	if ci.NumPending != 5 || ci.NumAckPending != 2 {
		t.Fatalf("the server counts %d pending and %d ack-pending, want 5 and 2", ci.NumPending, ci.NumAckPending)
	}
	status := c.Status()
	b := status.Backlog
	if b.Waiting != int64(ci.NumPending) || b.InFlight != int64(ci.NumAckPending) {
		t.Errorf("Status().Backlog %+v; the server counts %d pending, %d ack-pending", b, ci.NumPending, ci.NumAckPending)
	}
	if b.OldestAge <= 0 || b.OldestAge > status.BacklogAt.Sub(third.Time) {
		t.Errorf("Status().Backlog.OldestAge = %v, want the third message's age, at most %v", b.OldestAge, status.BacklogAt.Sub(third.Time))
	}
	waiting, inFlight, oldest := backlogGauges(t, reader)
	if waiting != b.Waiting || inFlight != b.InFlight || oldest != b.OldestAge.Seconds() {
		t.Errorf("custody.backlog.* gauges %d waiting, %d in flight, %v s oldest; Status().Backlog %+v", waiting, inFlight, oldest, b)
	}

	before := time.Now()
	direct, err := src.Backlog(e.ctx())
	after := time.Now()
	if err != nil {
		t.Fatal(err)
	}
	if lo, hi := before.Sub(third.Time), after.Sub(third.Time); direct.OldestAge < lo || direct.OldestAge > hi {
		t.Errorf("Backlog().OldestAge = %v, want the third message's age, from %v to %v", direct.OldestAge, lo, hi)
	}

	close(release)
	waitFor(t, "every message acked", func() bool {
		ci, err := src.cons.Info(e.ctx())
		return err == nil && ci.NumPending == 0 && ci.NumAckPending == 0
	})
	if b, err := src.Backlog(e.ctx()); err != nil || b.Waiting != 0 || b.InFlight != 0 || b.OldestAge != 0 {
		t.Errorf("Backlog() with nothing left: %+v, %v; want zeros", b, err)
	}
	if st := src.Stats(); st.BacklogRequests == 0 || st.BacklogRequestsFailed != 0 {
		t.Errorf("Stats: %d backlog requests, %d failed; want some, none failed", st.BacklogRequests, st.BacklogRequestsFailed)
	}
}
