package jetstream

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// TestReadinessFollowsTheConnection stops the test's own server under a
// running consumer: the consumer must report itself not ready (reconnecting,
// with an error) while the server is down, ready again once nats.go has
// reconnected, and handle what is published then. Closing the connection
// makes it disconnected for good.
func TestReadinessFollowsTheConnection(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	e := connect(t, srv.url(), reconnecting()...)
	name := uniqueName(t)
	e.stream(name, true)
	src, err := New(e.ctx(), e.js, name, "ready", WithCreate(jetstream.ConsumerConfig{AckWait: 5 * time.Second}),
		WithPollWait(200*time.Millisecond), WithRequestTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var handled atomic.Int64
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		handled.Add(1)
		return nil
	}), consumer.WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() { cancel(); <-done }()

	waitFor(t, "the consumer ready", func() bool { return c.Status().Ready })
	if st := c.Status(); st.Connection.State != "connected" {
		t.Fatalf("ready with connection %+v, want connected", st.Connection)
	}
	up := c.Status().Connection.Since

	srv.stop()
	waitFor(t, "the consumer not ready while the server is down", func() bool { return !c.Status().Ready })
	st := c.Status()
	if st.Connection.State != "reconnecting" || st.Connection.LastError == "" || !st.Connection.Since.After(up) {
		t.Errorf("with the server down: connection %+v, want reconnecting since the loss, with an error", st.Connection)
	}
	if st.Reason != "reconnecting" || !st.Live {
		t.Errorf("with the server down: reason %q, live %t; want reconnecting, live", st.Reason, st.Live)
	}

	srv.start()
	waitFor(t, "the consumer ready again", func() bool { return c.Status().Ready })
	if st := c.Status(); st.Connection.State != "connected" || st.Connection.LastError != "" {
		t.Errorf("after the restart: connection %+v, want connected, no error", st.Connection)
	}
	e.publish(name+".a", []byte("after"), nil)
	waitFor(t, "the message published after the restart handled", func() bool { return handled.Load() == 1 })

	e.nc.Close()
	waitFor(t, "the consumer disconnected once the connection is closed", func() bool {
		return c.Status().Connection.State == "disconnected"
	})
	if st := c.Status(); st.Ready || st.Connection.LastError == "" {
		t.Errorf("with the connection closed: %+v, want not ready, with an error", st)
	}
}
