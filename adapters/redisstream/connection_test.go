package redisstream

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// TestReadinessFollowsTheConnection kills the test's own server under a
// running consumer: the consumer must report itself not ready
// (reconnecting, with the error its commands met) while the server is
// down, ready again once a command gets an answer, and handle what is
// written then. Closing the client makes it disconnected for good.
func TestReadinessFollowsTheConnection(t *testing.T) {
	srv := startServer(t, true)
	client := newClient(t, srv.addr)
	e := newEnvOn(t, client)
	src := e.open(WithLease(5 * time.Second))
	var handled atomic.Int64
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		handled.Add(1)
		return nil
	}), consumer.WithLogger(quiet()))
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

	srv.kill()
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
	e.publish("after")
	waitFor(t, "the entry written after the restart handled", func() bool { return handled.Load() == 1 })

	client.Close()
	waitFor(t, "the consumer disconnected once the client is closed", func() bool {
		return c.Status().Connection.State == "disconnected"
	})
	if st := c.Status(); st.Ready || st.Connection.LastError == "" {
		t.Errorf("with the client closed: %+v, want not ready, with an error", st)
	}
}

// TestConnectionStateFromCommandOutcomes feeds the tracker the outcomes of
// real commands: an error reply is an answer (connected), a refused
// connection is not (reconnecting), a command its caller cancelled tells
// nothing, and the failure of a command sent before the answer that set
// the state does not undo it.
func TestConnectionStateFromCommandOutcomes(t *testing.T) {
	e := newEnv(t)
	ctx := e.ctx()
	reply := e.client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "none", Consumer: "c", Streams: []string{e.stream, ">"}, Block: -1}).Err()
	var re redis.Error
	if !errors.As(reply, &re) {
		t.Fatalf("XREADGROUP of a missing group: %v, want an error reply", reply)
	}
	down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	defer down.Close()
	refused := down.Ping(ctx).Err()
	if refused == nil {
		t.Fatal("a PING to port 1 succeeded")
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	gaveUp := e.client.Ping(cancelled).Err()

	var c connTracker
	t0 := time.Now()
	c.connected(t0)
	c.observe(t0.Add(1), reply)
	if st := c.connection(); st.State != adapters.Connected || st.LastError != nil {
		t.Errorf("after an error reply: %+v, want connected", st)
	}
	c.observe(t0.Add(2), refused)
	if st := c.connection(); st.State != adapters.Reconnecting || st.LastError != refused {
		t.Errorf("after a refused connection: %+v, want reconnecting with its error", st)
	}
	c.observe(t0.Add(3), gaveUp)
	if st := c.connection(); st.State != adapters.Reconnecting {
		t.Errorf("after a cancelled command (%v): %+v, want the state unchanged", gaveUp, st)
	}
	c.observe(t0.Add(5), nil)
	c.observe(t0.Add(4), refused) // sent before the answer above
	if st := c.connection(); st.State != adapters.Connected {
		t.Errorf("after a late failure of an earlier command: %+v, want connected", st)
	}
	c.observe(t0.Add(6), redis.ErrClosed)
	c.observe(t0.Add(7), nil)
	if st := c.connection(); st.State != adapters.Disconnected {
		t.Errorf("after the client closed: %+v, want disconnected", st)
	}
}
