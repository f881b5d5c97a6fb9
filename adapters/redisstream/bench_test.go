package redisstream

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmredis "github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/consumer"
)

// Benchmarks against a raw go-redis loop and Watermill's Redis Streams
// subscriber on the same Redis, in the same run, reported as ratios. Each
// iteration fills a fresh stream per reader with the same entries (one
// 256-byte body field) and consumes all of them; only the consuming is
// timed, from the reader's start (group already created) to the last entry
// handled. Run with a fixed, small count, for example:
//
//	go test -run '^$' -bench . -benchtime 3x ./adapters/redisstream/

const benchEntries = 20000

// benchFill appends n entries with a 256-byte body to stream and creates the
// group at its start.
func benchFill(b *testing.B, c *redis.Client, stream string, n int) {
	b.Helper()
	ctx := context.Background()
	body := strings.Repeat("x", 256)
	for start := 0; start < n; start += 1000 {
		pipe := c.Pipeline()
		for i := start; i < min(start+1000, n); i++ {
			pipe.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []string{DefaultBodyField, body}})
		}
		if _, err := pipe.Exec(ctx); err != nil {
			b.Fatal(err)
		}
	}
	if err := c.XGroupCreate(ctx, stream, "g", "0").Err(); err != nil {
		b.Fatal(err)
	}
}

func mallocs() uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.Mallocs
}

// rawConsume reads with XREADGROUP COUNT 256 and acks each entry with an
// XACK of its own, as a hand-written loop does. It returns the time taken
// and the commands sent.
func rawConsume(b *testing.B, c *redis.Client, stream string, n int) (time.Duration, int) {
	b.Helper()
	ctx := context.Background()
	start := time.Now()
	got, cmds := 0, 0
	for got < n {
		cmds++
		res, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "raw", Streams: []string{stream, ">"}, Count: 256, Block: 100 * time.Millisecond}).Result()
		if err != nil && err != redis.Nil {
			b.Fatal(err)
		}
		for _, st := range res {
			for _, m := range st.Messages {
				cmds++
				if err := c.XAck(ctx, stream, "g", m.ID).Err(); err != nil {
					b.Fatal(err)
				}
				got++
			}
		}
	}
	return time.Since(start), cmds
}

// custodyConsume consumes n entries through the Source and the runtime with
// a no-op handler, and returns the time taken and the Source's stats.
// inFlight 0 leaves the runtime's default (20 at concurrency 1 to 8).
func custodyConsume(b *testing.B, c *redis.Client, stream string, n, concurrency, inFlight int) (time.Duration, Stats) {
	b.Helper()
	src, err := New(context.Background(), c, stream, "g", WithBlock(100*time.Millisecond), WithLogger(quiet()))
	if err != nil {
		b.Fatal(err)
	}
	var count atomic.Int64
	done := make(chan struct{})
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if count.Add(1) == int64(n) {
			close(done)
		}
		return nil
	})
	opts := []consumer.Option{consumer.WithConcurrency(concurrency), consumer.WithLogger(quiet())}
	if inFlight > 0 {
		opts = append(opts, consumer.WithMaxInFlight(inFlight))
	}
	cons, err := consumer.New(src, h, opts...)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	start := time.Now()
	go func() { ran <- cons.Run(ctx) }()
	<-done
	took := time.Since(start)
	cancel()
	if err := <-ran; err != nil {
		b.Fatal(err)
	}
	return took, src.Stats()
}

// bodyUnmarshaller reads the benchmark's entries (one body field) as
// Watermill messages.
type bodyUnmarshaller struct{}

func (bodyUnmarshaller) Unmarshal(values map[string]any) (*message.Message, error) {
	s, _ := values[DefaultBodyField].(string)
	return message.NewMessage(watermill.NewShortUUID(), []byte(s)), nil
}

// watermillConsume consumes n entries with Watermill's Redis Streams
// subscriber, acking each, and returns the time taken. The subscriber gets a
// client of its own: its Close closes the client.
func watermillConsume(b *testing.B, stream string, n int) time.Duration {
	b.Helper()
	c := redis.NewClient(&redis.Options{Addr: redisAddr(), PoolSize: 64})
	sub, err := wmredis.NewSubscriber(wmredis.SubscriberConfig{
		Client: c, Unmarshaller: bodyUnmarshaller{}, ConsumerGroup: "g", Consumer: "watermill",
	}, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer sub.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	start := time.Now()
	msgs, err := sub.Subscribe(ctx, stream)
	if err != nil {
		b.Fatal(err)
	}
	for got := 0; got < n; got++ {
		m := <-msgs
		m.Ack()
	}
	return time.Since(start)
}

// BenchmarkNoop is the no-op throughput of the adapter under the runtime
// against a raw go-redis loop (XREADGROUP 256, XACK each) and Watermill's
// subscriber, on streams filled alike. The lever is XACK: the runtime
// gathers the acks of its workers into one XACK per batch.
func BenchmarkNoop(b *testing.B) {
	for _, cfg := range []struct{ concurrency, inFlight int }{{1, 0}, {1, 512}, {8, 512}} {
		b.Run(fmt.Sprintf("concurrency=%d/inflight=%d", cfg.concurrency, cfg.inFlight), func(b *testing.B) {
			benchNoop(b, cfg.concurrency, cfg.inFlight)
		})
	}
}

func benchNoop(b *testing.B, concurrency, inFlight int) {
	c := newClient(b, redisAddr())
	var (
		raw, cust, wm                   time.Duration
		rawCmds, custCmds, received     int64
		rawAllocs, custAllocs, wmAllocs uint64
	)
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		streams := make([]string, 3)
		for j := range streams {
			e := newEnvOn(b, c)
			streams[j] = e.stream
			benchFill(b, c, e.stream, benchEntries)
		}
		b.StartTimer()
		// Alternate the order: the machine is shared and its load drifts.
		order := []int{0, 1, 2}
		if i%2 == 1 {
			order = []int{2, 1, 0}
		}
		for _, k := range order {
			m0 := mallocs()
			switch k {
			case 0:
				took, cmds := rawConsume(b, c, streams[0], benchEntries)
				raw += took
				rawCmds += int64(cmds)
				rawAllocs += mallocs() - m0
			case 1:
				took, st := custodyConsume(b, c, streams[1], benchEntries, concurrency, inFlight)
				cust += took
				custCmds += st.Commands()
				received += st.Received
				custAllocs += mallocs() - m0
			case 2:
				wm += watermillConsume(b, streams[2], benchEntries)
				wmAllocs += mallocs() - m0
			}
		}
	}
	total := float64(benchEntries * b.N)
	b.ReportMetric(total/raw.Seconds(), "raw-msg/s")
	b.ReportMetric(total/cust.Seconds(), "custody-msg/s")
	b.ReportMetric(total/wm.Seconds(), "watermill-msg/s")
	b.ReportMetric(raw.Seconds()/cust.Seconds(), "ratio-raw")
	b.ReportMetric(wm.Seconds()/cust.Seconds(), "ratio-watermill")
	b.ReportMetric(float64(rawCmds)/total, "raw-cmds/msg")
	b.ReportMetric(float64(custCmds)/float64(received), "custody-cmds/msg")
	b.ReportMetric(float64(rawAllocs)/total, "raw-allocs/msg")
	b.ReportMetric(float64(custAllocs)/total, "custody-allocs/msg")
	b.ReportMetric(float64(wmAllocs)/total, "watermill-allocs/msg")
}

// BenchmarkRenewals holds 100 entries under a handler that runs for ten
// leases, and reports what keeping their leases costs: renewal commands per
// entry per lease period (the goal: at most 0.05). Renewing each entry on
// its own at a third of the lease would cost 3.
func BenchmarkRenewals(b *testing.B) {
	const (
		held  = 100
		lease = 300 * time.Millisecond
		hold  = 10 * lease
	)
	c := newClient(b, redisAddr())
	var renewals, renewed int64
	var periods float64
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		e := newEnvOn(b, c)
		benchFill(b, c, e.stream, held)
		b.StartTimer()
		src, err := New(context.Background(), c, e.stream, "g", WithLease(lease), WithBlock(50*time.Millisecond), WithLogger(quiet()))
		if err != nil {
			b.Fatal(err)
		}
		var count atomic.Int64
		done := make(chan struct{})
		h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			select {
			case <-time.After(hold):
			case <-ctx.Done():
				return context.Cause(ctx)
			}
			if count.Add(1) == held {
				close(done)
			}
			return nil
		})
		cons, err := consumer.New(src, h, consumer.WithConcurrency(held), consumer.WithMaxInFlight(held), consumer.WithLogger(quiet()))
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		ran := make(chan error, 1)
		start := time.Now()
		go func() { ran <- cons.Run(ctx) }()
		<-done
		took := time.Since(start)
		cancel()
		if err := <-ran; err != nil {
			b.Fatal(err)
		}
		st := src.Stats()
		if st.Received != held || st.LeaseLost != 0 {
			b.Fatalf("received %d, lost %d leases; want %d and 0", st.Received, st.LeaseLost, held)
		}
		renewals += st.Renewals
		renewed += st.Renewed
		periods += float64(held) * took.Seconds() / lease.Seconds()
	}
	b.ReportMetric(float64(renewals)/periods, "renewal-cmds/entry/lease")
	b.ReportMetric(float64(renewed)/float64(renewals), "entries/renewal-cmd")
}
