package kafka

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// startConsumer runs a custody consumer over s and returns it; Run ends at
// the end of the test, or when stop is called.
func startConsumer(t *testing.T, s *Source, h consumer.HandlerFunc, opts ...consumer.Option) (c *consumer.Consumer, stop func()) {
	t.Helper()
	c, err := consumer.New(s, h, append([]consumer.Option{consumer.WithLogger(testlog.New(t))}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Run: %v", err)
				}
			case <-time.After(60 * time.Second):
				t.Errorf("Run did not return")
			}
		})
	}
	t.Cleanup(stop)
	return c, stop
}

// The connection state follows the outcome of the client's attempts:
// connecting until one succeeds, connected while one broker answers,
// reconnecting once the last attempt to every broker failed, with that
// error, and disconnected for good once closed.
func TestConnWatchFollowsTheAttempts(t *testing.T) {
	w := newConnWatch(slog.New(slog.DiscardHandler), "test")
	a := kgo.BrokerMetadata{NodeID: 1, Host: "10.0.0.1", Port: 9092}
	b := kgo.BrokerMetadata{NodeID: 2, Host: "10.0.0.2", Port: 9092}
	refused := syscall.ECONNREFUSED
	check := func(what string, want adapters.ConnState, wantErr bool) adapters.Connection {
		t.Helper()
		c := w.connection()
		if c.State != want || (c.LastError != nil) != wantErr || c.Since.IsZero() {
			t.Fatalf("%s: connection %+v; want %v, error %t", what, c, want, wantErr)
		}
		return c
	}
	check("new", adapters.Connecting, false)
	w.OnBrokerConnect(a, 0, nil, refused)
	if c := check("after a failed first attempt", adapters.Connecting, true); !errors.Is(c.LastError, refused) {
		t.Fatalf("LastError = %v, want the refusal", c.LastError)
	}
	w.OnBrokerConnect(a, 0, nil, nil)
	w.OnBrokerConnect(b, 0, nil, nil)
	up := check("connected", adapters.Connected, false)
	w.OnBrokerConnect(a, 0, nil, refused)
	check("one broker of two down", adapters.Connected, false)
	w.OnBrokerConnect(a, 0, nil, context.Canceled) // an attempt given up: no news
	time.Sleep(time.Millisecond)
	w.OnBrokerConnect(b, 0, nil, refused)
	c := check("every broker down", adapters.Reconnecting, true)
	if !c.Since.After(up.Since) {
		t.Fatalf("reconnecting since %v, not after connected since %v", c.Since, up.Since)
	}
	w.OnBrokerConnect(b, 0, nil, nil)
	check("back", adapters.Connected, false)
	w.close()
	w.OnBrokerConnect(a, 0, nil, nil)
	check("closed", adapters.Disconnected, false)
}

// A consumer over a Kafka Source reports its partitions and its connection
// in Status: ready and connected while the cluster answers, not ready
// (reconnecting, with the error) while it is down, ready again once it is
// back, and the Source disconnected once the consumer stopped.
func TestStatusFollowsTheCluster(t *testing.T) {
	fake, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(3, "orders"))
	if err != nil {
		t.Fatal(err)
	}
	addr := fake.ListenAddrs()[0]
	_, portStr, _ := net.SplitHostPort(addr)
	port, _ := strconv.Atoi(portStr)
	var restarted *kfake.Cluster
	defer func() {
		fake.Close()
		if restarted != nil {
			restarted.Close()
		}
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := New(ctx, WithBrokers(addr), WithGroup(newGroup()), WithTopics("orders"),
		WithPollWait(100*time.Millisecond), WithLogger(testlog.New(t)),
		WithClientOptions(kgo.HeartbeatInterval(100*time.Millisecond), kgo.FetchMaxWait(100*time.Millisecond),
			kgo.RetryBackoffFn(func(int) time.Duration { return 50 * time.Millisecond })))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c, stop := startConsumer(t, s, func(context.Context, *consumer.Message) error { return nil })

	eventually(t, "the consumer ready with its partitions", func() bool {
		st := c.Status()
		return st.Ready && len(st.Assigned) == 3
	})
	st := c.Status()
	if st.Connection.State != "connected" || st.Connection.LastError != "" {
		t.Fatalf("ready with connection %+v, want connected, no error", st.Connection)
	}
	if want := []string{"orders/0", "orders/1", "orders/2"}; !slices.Equal(st.Assigned, want) {
		t.Fatalf("Assigned = %v, want %v", st.Assigned, want)
	}
	up := st.Connection.Since

	fake.Close()
	eventually(t, "the consumer not ready with the cluster down", func() bool { return !c.Status().Ready })
	st = c.Status()
	if st.Connection.State != "reconnecting" || st.Connection.LastError == "" || !st.Connection.Since.After(up) {
		t.Fatalf("with the cluster down: connection %+v, want reconnecting since the loss, with an error", st.Connection)
	}
	if st.Reason != "reconnecting" || !st.Live {
		t.Fatalf("with the cluster down: reason %q, live %t; want reconnecting, live", st.Reason, st.Live)
	}

	restarted, err = kfake.NewCluster(kfake.NumBrokers(1), kfake.Ports(port), kfake.SeedTopics(3, "orders"))
	if err != nil {
		t.Fatalf("starting the cluster again on %s: %v", addr, err)
	}
	eventually(t, "the consumer ready again", func() bool { return c.Status().Ready })
	if st := c.Status(); st.Connection.State != "connected" || st.Connection.LastError != "" {
		t.Fatalf("after the restart: connection %+v, want connected, no error", st.Connection)
	}
	// (A restarted kfake cluster is a new one: its topics have new IDs,
	// which the client does not fetch by; a real broker's restart keeps
	// them. Consuming after it is not this test's business.)

	stop()
	if conn := s.Connection(); conn.State != adapters.Disconnected {
		t.Fatalf("after Run returned, the Source's connection is %+v, want disconnected", conn)
	}
}
