package kafka

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// New reaches the cluster before it returns: with no broker that
// answers, it fails with the cause, naming the addresses it tried, instead
// of returning a Source that polls nothing for ever.
func TestNewFailsWhenNoBrokerAnswers(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := New(ctx, WithBrokers("127.0.0.1:1"), WithGroup("g"), WithTopics("t"), WithLogger(slog.New(slog.DiscardHandler)))
	if err == nil {
		s.Close()
		t.Fatal("New with no reachable broker returned a Source")
	}
	if !errors.Is(err, syscall.ECONNREFUSED) || !strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Fatalf("New = %v; want the refused connection, naming 127.0.0.1:1", err)
	}
}

// A broker that accepts connections and never answers: New gives up
// when its context ends, with the context's error.
func TestNewGivesUpWhenItsContextEnds(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var conns sync.WaitGroup
	var mu sync.Mutex
	var open []net.Conn
	conns.Add(1)
	go func() { // accept, and say nothing
		defer conns.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			open = append(open, c)
			mu.Unlock()
		}
	}()
	defer func() {
		ln.Close()
		conns.Wait()
		mu.Lock()
		for _, c := range open {
			c.Close()
		}
		mu.Unlock()
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	returned := make(chan error, 1)
	go func() {
		s, err := New(ctx, WithBrokers(ln.Addr().String()), WithGroup("g"), WithTopics("t"), WithLogger(slog.New(slog.DiscardHandler)))
		if err == nil {
			s.Close()
		}
		returned <- err
	}()
	select {
	case err := <-returned:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("New = %v; want the context's deadline", err)
		}
	case <-time.After(30 * time.Second): // hang guard
		t.Fatal("New did not return after its context ended")
	}
}

// records keeps the log records of a logger, for tests to look at.
type records struct {
	mu  sync.Mutex
	all []slog.Record
}

func (r *records) Enabled(context.Context, slog.Level) bool { return true }
func (r *records) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.all = append(r.all, rec.Clone())
	return nil
}
func (r *records) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *records) WithGroup(string) slog.Handler      { return r }

// find returns the records at level whose message starts with msg, each as
// its attributes.
func (r *records) find(level slog.Level, msg string) []map[string]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []map[string]string
	for _, rec := range r.all {
		if rec.Level != level || !strings.HasPrefix(rec.Message, msg) {
			continue
		}
		attrs := map[string]string{}
		rec.Attrs(func(a slog.Attr) bool {
			attrs[a.Key] = a.Value.String()
			return true
		})
		out = append(out, attrs)
	}
	return out
}

// dialFailures counts the client's failed connection attempts.
type dialFailures struct{ n atomic.Int64 }

func (d *dialFailures) OnBrokerConnect(_ kgo.BrokerMetadata, _ time.Duration, _ net.Conn, err error) {
	if err != nil {
		d.n.Add(1)
	}
}

// A broker that goes away while the Source runs is logged once, with its
// address and the error, however often the client tries it again; the
// connection back is logged once too.
func TestLostBrokerIsLoggedOncePerChange(t *testing.T) {
	fake, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"))
	if err != nil {
		t.Fatal(err)
	}
	addr := fake.ListenAddrs()[0]
	_, portStr, _ := net.SplitHostPort(addr)
	port, _ := strconv.Atoi(portStr)

	logs := &records{}
	failures := &dialFailures{}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := New(ctx, WithBrokers(addr), WithGroup(newGroup()), WithTopics("orders"),
		WithPollWait(100*time.Millisecond), WithLogger(slog.New(logs)),
		WithClientOptions(kgo.WithHooks(failures), kgo.HeartbeatInterval(100*time.Millisecond),
			kgo.RetryBackoffFn(func(int) time.Duration { return 50 * time.Millisecond })))
	if err != nil {
		fake.Close()
		t.Fatal(err)
	}
	// Keep the client at work (group, fetches) as the runtime would.
	stop := make(chan struct{})
	polled := make(chan struct{})
	go func() {
		defer close(polled)
		for {
			select {
			case <-stop:
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			_, _ = s.Receive(ctx, 10)
			cancel()
		}
	}()
	var restarted *kfake.Cluster
	defer func() {
		close(stop)
		<-polled
		s.Close()
		if restarted != nil {
			restarted.Close()
		}
	}()

	eventually(t, "the Source to connect", func() bool { return len(fake.ListenAddrs()) > 0 && s.Client().Ping(ctx) == nil })
	fake.Close()
	eventually(t, "the client to try the broker several times", func() bool { return failures.n.Load() >= 5 })
	warned := logs.find(slog.LevelWarn, "kafka: cannot connect to a broker")
	if len(warned) != 1 || warned[0]["broker"] != addr || warned[0]["error"] == "" {
		t.Fatalf("after %d failed attempts, logged %v; want one warning naming %s and the error", failures.n.Load(), warned, addr)
	}

	restarted, err = kfake.NewCluster(kfake.NumBrokers(1), kfake.Ports(port), kfake.SeedTopics(1, "orders"))
	if err != nil {
		t.Fatalf("starting the broker again on %s: %v", addr, err)
	}
	eventually(t, "the connection back to be logged", func() bool {
		return len(logs.find(slog.LevelInfo, "kafka: connected to the broker again")) > 0
	})
	back := logs.find(slog.LevelInfo, "kafka: connected to the broker again")
	warned = logs.find(slog.LevelWarn, "kafka: cannot connect to a broker")
	if len(back) != 1 || back[0]["broker"] != addr || len(warned) != 1 {
		t.Fatalf("logged %d warnings and the connection back %v; want one of each, naming %s", len(warned), back, addr)
	}
}

// The dead-letter sink's own client logs a broker it cannot reach the same
// way: once, however often a produce tries it.
func TestDeadLetterSinkLogsAnUnreachableBrokerOnce(t *testing.T) {
	fake, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "dlq"))
	if err != nil {
		t.Fatal(err)
	}
	addr := fake.ListenAddrs()[0]
	logs := &records{}
	failures := &dialFailures{}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dl, err := NewDeadLetter(ctx, "dlq", WithBrokers(addr), WithLogger(slog.New(logs)),
		WithClientOptions(kgo.WithHooks(failures), kgo.MetadataMinAge(50*time.Millisecond),
			kgo.RetryBackoffFn(func(int) time.Duration { return 20 * time.Millisecond })))
	if err != nil {
		fake.Close()
		t.Fatal(err)
	}
	defer dl.Close()
	fake.Close()
	sent := make(chan error, 1)
	sendCtx, stop := context.WithCancel(context.Background())
	go func() {
		sent <- dl.Send(sendCtx, &adapters.Delivery{ID: "t/0/1", Queue: "t", Body: []byte("x")}, adapters.Failure{Err: errors.New("poison")})
	}()
	eventually(t, "the sink's client to try the broker several times", func() bool { return failures.n.Load() >= 3 })
	stop()
	if err := <-sent; err == nil {
		t.Fatal("Send to an unreachable cluster returned nil")
	}
	warned := logs.find(slog.LevelWarn, "kafka: cannot connect to a broker")
	if len(warned) != 1 || warned[0]["broker"] != addr || !strings.Contains(warned[0]["client"], "dead-letter") {
		t.Fatalf("after %d failed attempts, logged %v; want one warning from the dead-letter sink naming %s", failures.n.Load(), warned, addr)
	}
}

// NewDeadLetter reaches the cluster and looks the topic up before it
// returns: with no broker that answers, or no such topic, it fails with the
// cause, instead of returning a sink whose every Send fails, which would
// keep poison records waiting for ever.
func TestNewDeadLetterChecksTheClusterAndTheTopic(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	quiet := WithLogger(slog.New(slog.DiscardHandler))
	dl, err := NewDeadLetter(ctx, "dlq", WithBrokers("127.0.0.1:1"), quiet)
	if err == nil {
		dl.Close()
		t.Fatal("NewDeadLetter with no reachable broker returned a sink")
	}
	if !errors.Is(err, syscall.ECONNREFUSED) || !strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Fatalf("NewDeadLetter = %v; want the refused connection, naming 127.0.0.1:1", err)
	}

	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	if dl, err := NewDeadLetter(ctx, "orders.dlq", WithBrokers(c.addrs...), quiet); err == nil {
		dl.Close()
		t.Fatal("NewDeadLetter on a topic that does not exist returned a sink")
	} else if !strings.Contains(err.Error(), `dead-letter topic "orders.dlq" does not exist`) {
		t.Fatalf("NewDeadLetter = %v; want it to say the topic does not exist", err)
	}
	s := c.open(t, newGroup(), "orders")
	if dl, err := s.NewDeadLetter(ctx, "orders.dlq"); err == nil {
		dl.Close()
		t.Fatal("Source.NewDeadLetter on a topic that does not exist returned a sink")
	} else if !strings.Contains(err.Error(), `dead-letter topic "orders.dlq" does not exist`) {
		t.Fatalf("Source.NewDeadLetter = %v; want it to say the topic does not exist", err)
	}
	// A client that creates topics on demand needs none.
	dl, err = NewDeadLetter(ctx, "orders.dlq", WithBrokers(c.addrs...), quiet, WithClientOptions(kgo.AllowAutoTopicCreation()))
	if err != nil {
		t.Fatalf("NewDeadLetter with kgo.AllowAutoTopicCreation = %v, want a sink", err)
	}
	dl.Close()
}
