package awssqs

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// gauges returns the last value of every int64 gauge the reader holds, by
// name.
func gauges(t *testing.T, r *sdkmetric.ManualReader) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if g, ok := m.Data.(metricdata.Gauge[int64]); ok {
				for _, p := range g.DataPoints {
					got[m.Name] = p.Value
				}
			}
		}
	}
	return got
}

// TestBacklogMatchesTheQueuesCount: a running consumer holding some of a
// queue's messages reports, in its Status and its gauges, the backlog SQS
// counts: the messages it has not received as waiting, those it holds as in
// flight, and no oldest age (SQS's API does not tell it).
func TestBacklogMatchesTheQueuesCount(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 60*time.Second, nil)
	const published, held = 30, 5
	for i := range published {
		e.send(url, fmt.Sprint(i), "", nil)
	}
	srcReader := sdkmetric.NewManualReader()
	srcMP := sdkmetric.NewMeterProvider(sdkmetric.WithReader(srcReader))
	t.Cleanup(func() { srcMP.Shutdown(context.Background()) })
	src, err := New(e.ctx(), e.client, url, testOptions(WithMeterProvider(srcMP))...)
	if err != nil {
		t.Fatal(err)
	}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { mp.Shutdown(context.Background()) })
	release := make(chan struct{})
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}),
		consumer.WithLogger(testlog.New(t)), consumer.WithMeterProvider(mp),
		consumer.WithConcurrency(3), consumer.WithMaxInFlight(held),
		consumer.WithBacklogInterval(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- c.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-ran; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()

	waitFor(t, "the consumer to hold its fill", func() bool { return c.Status().Held == held })
	since := time.Now()
	waitFor(t, "a backlog poll after that", func() bool { return c.Status().BacklogAt.After(since) })
	want := adapters.Backlog{Waiting: published - held, InFlight: held}
	if b := c.Status().Backlog; b != want {
		t.Errorf("Status().Backlog = %+v, want %+v", b, want)
	}
	if v, f := e.counts(url); v != int(want.Waiting) || f != int(want.InFlight) {
		t.Errorf("the queue itself counts %d available and %d in flight, want %+v", v, f, want)
	}
	g := gauges(t, reader)
	if g["custody.backlog.waiting"] != want.Waiting || g["custody.backlog.in_flight"] != want.InFlight {
		t.Errorf("gauges waiting %d, in flight %d; want %+v", g["custody.backlog.waiting"], g["custody.backlog.in_flight"], want)
	}
	var rm metricdata.ResourceMetrics
	reader.Collect(context.Background(), &rm)
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == "custody.backlog.oldest_age" {
				if d, ok := m.Data.(metricdata.Gauge[float64]); ok && len(d.DataPoints) > 0 {
					t.Errorf("custody.backlog.oldest_age reported (%v); SQS does not tell it", d.DataPoints)
				}
			}
		}
	}
	if n := sums(t, srcReader, "custody.sqs.requests", "operation", "result")[src.name+"/GetQueueAttributes/ok"]; n < 1 {
		t.Errorf("custody.sqs.requests counts %d backlog polls, want at least 1", n)
	}

	// Once the handlers finish, the queue drains and the backlog says so.
	close(release)
	waitFor(t, "a backlog of zero", func() bool {
		b := c.Status().Backlog
		return b.Waiting == 0 && b.InFlight == 0
	})
}

// TestBacklogAfterClose: a closed Source does not ask SQS.
func TestBacklogAfterClose(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := src.Backlog(e.ctx()); err != nil {
		t.Fatalf("Backlog: %v", err)
	}
	src.Close()
	e.counter.Reset()
	if _, err := src.Backlog(e.ctx()); !errors.Is(err, adapters.ErrClosed) {
		t.Errorf("Backlog after Close: %v, want adapters.ErrClosed", err)
	}
	if n := e.counter.Total(); n != 0 {
		t.Errorf("Backlog after Close made %d requests", n)
	}
}
