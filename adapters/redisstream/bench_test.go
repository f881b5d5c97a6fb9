package redisstream

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmredis "github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/adapters"
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

// variant adjusts what the Source declares, to compare declarations in
// one run; nil keeps them.
type variant struct {
	name string
	caps func(*adapters.Capabilities)
}

// custodyConsume consumes n entries through the Source and the runtime with
// a no-op handler, and returns the time taken and the Source's stats.
// inFlight 0 leaves the runtime's default (20 at concurrency 1 to 8).
func custodyConsume(b *testing.B, c *redis.Client, stream string, n, concurrency, inFlight int, v variant) (time.Duration, Stats) {
	b.Helper()
	src, err := New(context.Background(), c, stream, "g", WithBlock(100*time.Millisecond), WithLogger(quiet()))
	if err != nil {
		b.Fatal(err)
	}
	if v.caps != nil {
		v.caps(&src.caps)
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
// gathers the acks of its workers into one XACK per batch. Beside the
// Source as it declares itself ("custody"), the same run measures two
// Receive calls at once ("receivers=2"), which the Source does not
// declare: a read hands out at once what the stream holds, so the
// in-flight window, not the read, bounds the throughput.
func BenchmarkNoop(b *testing.B) {
	variants := []variant{
		{name: "custody"},
		{name: "receivers=2", caps: func(c *adapters.Capabilities) { c.Receivers = 2 }},
	}
	for _, cfg := range []struct{ concurrency, inFlight int }{{1, 0}, {1, 512}, {8, 512}} {
		b.Run(fmt.Sprintf("concurrency=%d/inflight=%d", cfg.concurrency, cfg.inFlight), func(b *testing.B) {
			benchNoop(b, cfg.concurrency, cfg.inFlight, variants)
		})
	}
}

func benchNoop(b *testing.B, concurrency, inFlight int, variants []variant) {
	c := newClient(b, redisAddr())
	// Readers: 0 the raw loop, 1 Watermill, 2 on the variants.
	n := 2 + len(variants)
	took := make([][]time.Duration, n) // by reader, by iteration
	cmds := make([]int64, n)
	received := make([]int64, n)
	allocs := make([]uint64, n)
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		streams := make([]string, n)
		for j := range streams {
			e := newEnvOn(b, c)
			streams[j] = e.stream
			benchFill(b, c, e.stream, benchEntries)
		}
		b.StartTimer()
		// Alternate the order: the machine is shared and its load drifts.
		for j := range n {
			k := j
			if i%2 == 1 {
				k = n - 1 - j
			}
			m0 := mallocs()
			var t time.Duration
			switch k {
			case 0:
				var c0 int
				t, c0 = rawConsume(b, c, streams[k], benchEntries)
				cmds[k] += int64(c0)
				received[k] += benchEntries
			case 1:
				t = watermillConsume(b, streams[k], benchEntries)
			default:
				var st Stats
				t, st = custodyConsume(b, c, streams[k], benchEntries, concurrency, inFlight, variants[k-2])
				cmds[k] += st.Commands()
				received[k] += st.Received
			}
			took[k] = append(took[k], t)
			allocs[k] += mallocs() - m0
		}
	}
	total := float64(benchEntries * b.N)
	name := func(k int) string {
		switch k {
		case 0:
			return "raw"
		case 1:
			return "watermill"
		}
		return variants[k-2].name
	}
	for k := range n {
		b.ReportMetric(benchEntries/medianOf(took[k]).Seconds(), name(k)+"-msg/s")
		b.ReportMetric(float64(allocs[k])/total, name(k)+"-allocs/msg")
		if k != 1 {
			b.ReportMetric(float64(cmds[k])/float64(received[k]), name(k)+"-cmds/msg")
		}
		if k >= 2 {
			b.ReportMetric(medianRatio(took[0], took[k]), name(k)+"-ratio-raw")
			b.ReportMetric(medianRatio(took[1], took[k]), name(k)+"-ratio-watermill")
		}
		if k > 2 {
			b.ReportMetric(medianRatio(took[2], took[k]), name(k)+"-ratio-custody")
		}
	}
}

// medianOf returns the median of ts.
func medianOf(ts []time.Duration) time.Duration {
	s := slices.Clone(ts)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// medianRatio returns the median over iterations of base[i]/t[i]: how many
// times faster t was than base in the same iteration. Pairs taken in the
// same iteration share the machine's load of the moment, which varies on a
// shared machine far more than the readers differ.
func medianRatio(base, t []time.Duration) float64 {
	r := make([]float64, len(t))
	for i := range t {
		r[i] = base[i].Seconds() / t[i].Seconds()
	}
	slices.Sort(r)
	if len(r)%2 == 1 {
		return r[len(r)/2]
	}
	return (r[len(r)/2-1] + r[len(r)/2]) / 2
}

// BenchmarkAckLinger compares the ack batching the Source declares (sent
// by the runtime's goroutines after a linger, several calls under way)
// with acks sent by the workers as soon as they run out of work (no
// linger), on the local Redis and with a round trip made longer by a hook
// that sleeps before each command (as Redis over a network would be), in
// the same run.
func BenchmarkAckLinger(b *testing.B) {
	const n = 5000
	variants := []variant{
		{name: "linger"},
		{name: "no-linger", caps: func(c *adapters.Capabilities) {
			c.Ack = adapters.Batching{MaxEntries: c.Ack.MaxEntries}
		}},
	}
	for _, delay := range []time.Duration{0, 200 * time.Microsecond} {
		for _, concurrency := range []int{1, 8, 32} {
			b.Run(fmt.Sprintf("delay=%v/concurrency=%d", delay, concurrency), func(b *testing.B) {
				c := newClient(b, redisAddr())
				if delay > 0 {
					c.AddHook(delayHook(delay))
				}
				took := make([][]time.Duration, len(variants))
				cmds := make([]int64, len(variants))
				for i := 0; i < b.N; i++ {
					b.StopTimer()
					streams := make([]string, len(variants))
					for j := range streams {
						e := newEnvOn(b, c)
						streams[j] = e.stream
						benchFill(b, c, e.stream, n)
					}
					b.StartTimer()
					for j := range variants {
						k := j
						if i%2 == 1 {
							k = len(variants) - 1 - j
						}
						t, st := custodyConsume(b, c, streams[k], n, concurrency, 0, variants[k])
						took[k] = append(took[k], t)
						cmds[k] += st.Commands()
					}
				}
				for k, v := range variants {
					b.ReportMetric(n/medianOf(took[k]).Seconds(), v.name+"-msg/s")
					b.ReportMetric(float64(cmds[k])/float64(n*b.N), v.name+"-cmds/msg")
				}
				b.ReportMetric(medianRatio(took[1], took[0]), "linger-speedup")
			})
		}
	}
}

// delayHook sleeps before every command it sees, as a longer round trip.
type delayHook time.Duration

func (h delayHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h delayHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		time.Sleep(time.Duration(h))
		return next(ctx, cmd)
	}
}
func (h delayHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		time.Sleep(time.Duration(h))
		return next(ctx, cmds)
	}
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
