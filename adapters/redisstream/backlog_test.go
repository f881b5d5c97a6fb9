package redisstream

import (
	"context"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/custody-go/custody/consumer"
)

// TestBacklogMatchesTheGroupInfo holds two of seven entries in handlers
// that wait: the runtime's Status().Backlog and its custody.backlog.*
// gauges must show the group's own counts (a lag of five, two pending), and
// the oldest waiting entry's age must be that of the third entry, the first
// not yet delivered.
func TestBacklogMatchesTheGroupInfo(t *testing.T) {
	e := newEnv(t)
	// Pauses between the writes set the ids' times apart, so that the age
	// of another entry than the third would fall outside the bounds below.
	var ids []string
	for i, body := range []string{"a", "b", "c", "d", "e", "f", "g"} {
		if i == 2 || i == 3 {
			time.Sleep(100 * time.Millisecond)
		}
		ids = append(ids, e.publish(body)...)
	}
	third := idTime(ids[2])
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	src := e.open(WithLease(30 * time.Second))
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
	}), consumer.WithLogger(quiet()), consumer.WithConcurrency(2), consumer.WithMaxInFlight(2),
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
	// the read: wait for the one after it.
	held := time.Now()
	waitFor(t, "a backlog poll ending after two entries were held", func() bool { return c.Status().BacklogAt.After(held) })
	polled := c.Status().BacklogAt
	waitFor(t, "the next backlog poll", func() bool { return c.Status().BacklogAt.After(polled) })

	groups, err := e.client.XInfoGroups(e.ctx(), e.stream).Result()
	if err != nil || len(groups) != 1 {
		t.Fatalf("XINFO GROUPS: %v, %v", groups, err)
	}
	g := groups[0]
	if g.Lag != 5 || g.Pending != 2 {
		t.Fatalf("the group's lag is %d and pending %d, want 5 and 2", g.Lag, g.Pending)
	}
	status := c.Status()
	b := status.Backlog
	if b.Waiting != g.Lag || b.InFlight != g.Pending {
		t.Errorf("Status().Backlog %+v; the group's lag is %d, pending %d", b, g.Lag, g.Pending)
	}
	if b.OldestAge <= 0 || b.OldestAge > status.BacklogAt.Sub(third) {
		t.Errorf("Status().Backlog.OldestAge = %v, want the third entry's age, at most %v", b.OldestAge, status.BacklogAt.Sub(third))
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
	if lo, hi := before.Sub(third), after.Sub(third); direct.OldestAge < lo || direct.OldestAge > hi {
		t.Errorf("Backlog().OldestAge = %v, want the third entry's age, from %v to %v", direct.OldestAge, lo, hi)
	}

	close(release)
	waitFor(t, "every entry acked", func() bool { return len(e.pending()) == 0 && src.Stats().Received == 7 })
	if b, err := src.Backlog(e.ctx()); err != nil || b.Waiting != 0 || b.InFlight != 0 || b.OldestAge != 0 {
		t.Errorf("Backlog() with nothing left: %+v, %v; want zeros", b, err)
	}
}

// backlogGauges returns the runtime's custody.backlog.* gauges as reader
// collects them; -1 for those not reported.
func backlogGauges(t *testing.T, reader *sdkmetric.ManualReader) (waiting, inFlight int64, oldest float64) {
	t.Helper()
	waiting, inFlight, oldest = -1, -1, -1
	for name, a := range collect(t, reader) {
		switch g := a.(type) {
		case metricdata.Gauge[int64]:
			if len(g.DataPoints) == 1 && name == "custody.backlog.waiting" {
				waiting = g.DataPoints[0].Value
			}
			if len(g.DataPoints) == 1 && name == "custody.backlog.in_flight" {
				inFlight = g.DataPoints[0].Value
			}
		case metricdata.Gauge[float64]:
			if len(g.DataPoints) == 1 && name == "custody.backlog.oldest_age" {
				oldest = g.DataPoints[0].Value
			}
		}
	}
	return waiting, inFlight, oldest
}

// TestBacklogWhenRedisCannotTellTheLag deletes an entry the group has not
// read: Redis then cannot count the lag, and Backlog says so (-1, which the
// runtime leaves out of its gauge) while still telling the age of the
// oldest entry left to deliver.
func TestBacklogWhenRedisCannotTellTheLag(t *testing.T) {
	e := newEnv(t)
	ids := e.publish("a", "b", "c")
	src := e.open()
	defer src.Close()
	receiveN(t, src, 1)
	if err := e.client.XDel(e.ctx(), e.stream, ids[1]).Err(); err != nil {
		t.Fatal(err)
	}
	groups, err := e.client.XInfoGroups(e.ctx(), e.stream).Result()
	if err != nil || len(groups) != 1 || groups[0].Lag != -1 {
		t.Fatalf("XINFO GROUPS after the deletion: %+v, %v; want a lag Redis cannot tell", groups, err)
	}
	before := time.Now()
	b, err := src.Backlog(e.ctx())
	after := time.Now()
	if err != nil {
		t.Fatal(err)
	}
	c := idTime(ids[2])
	if b.Waiting != -1 || b.InFlight != 1 || b.OldestAge < before.Sub(c) || b.OldestAge > after.Sub(c) {
		t.Errorf("Backlog() = %+v, want -1 waiting, 1 in flight, the third entry's age (%v to %v)", b, before.Sub(c), after.Sub(c))
	}
}
