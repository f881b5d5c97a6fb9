package jetstream

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmjs "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/jetstream"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// Benchmarks against the raw client and Watermill's JetStream subscriber on
// the same server, in the same run, reported as ratios. Each iteration fills
// a fresh stream per reader with the same messages (256-byte bodies, file
// storage) and consumes all of them through a durable pull consumer; only
// the consuming is timed. Run with a fixed, small count, for example:
//
//	go test -run '^$' -bench . -benchtime 3x -count 1 ./adapters/jetstream/

const benchMessages = 20000

// benchStream makes a stream whose name is also its one subject (as
// Watermill's subscriber expects), fills it with n messages and returns the
// name.
func benchStream(b *testing.B, e *env, n int) string {
	b.Helper()
	name := uniqueName(b)
	if _, err := e.js.CreateStream(e.ctx(), jetstream.StreamConfig{Name: name, Subjects: []string{name}, Storage: jetstream.FileStorage}); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		e.js.DeleteStream(ctx, name)
	})
	body := make([]byte, 256)
	for i := range body {
		body[i] = byte('a' + i%26)
	}
	// In chunks, each confirmed before the next: a loaded server slows its
	// PubAcks, and nats.go stalls a publisher with too many outstanding.
	const chunk = 1000
	for i := 0; i < n; i += chunk {
		for range min(chunk, n-i) {
			if _, err := e.js.PublishAsync(name, body); err != nil {
				b.Fatal(err)
			}
		}
		select {
		case <-e.js.PublishAsyncComplete():
		case <-time.After(time.Minute):
			b.Fatal("fill not confirmed")
		}
	}
	return name
}

func benchConsumer(b *testing.B, e *env, stream string) jetstream.Consumer {
	b.Helper()
	c, err := e.js.CreateOrUpdateConsumer(e.ctx(), stream, jetstream.ConsumerConfig{
		Durable: "bench", AckPolicy: jetstream.AckExplicitPolicy, AckWait: 30 * time.Second, MaxAckPending: 1024,
	})
	if err != nil {
		b.Fatal(err)
	}
	return c
}

func mallocs() uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.Mallocs
}

// rawConsume reads n messages with a plain nats.go pull loop, fetching 256
// at a time (Fetch, which waits for the batch up to an expiry, or
// FetchNoWait, which takes what is ready) and acking each message:
// fire-and-forget (Ack) or acknowledged (DoubleAck, one round trip each).
func rawConsume(b *testing.B, stream string, n int, noWait, double bool) time.Duration {
	b.Helper()
	e := newEnv(b)
	c := benchConsumer(b, e, stream)
	ctx := context.Background()
	start := time.Now()
	for got := 0; got < n; {
		var (
			batch jetstream.MessageBatch
			err   error
		)
		if noWait {
			batch, err = c.FetchNoWait(256)
		} else {
			batch, err = c.Fetch(256, jetstream.FetchMaxWait(2*time.Second))
		}
		if err != nil {
			b.Fatal(err)
		}
		for m := range batch.Messages() {
			if double {
				err = m.DoubleAck(ctx)
			} else {
				err = m.Ack()
			}
			if err != nil {
				b.Fatal(err)
			}
			got++
		}
		if err := batch.Error(); err != nil {
			b.Fatal(err)
		}
	}
	if !double {
		// The acks were only written: wait until the server has them all.
		if err := e.nc.Flush(); err != nil {
			b.Fatal(err)
		}
	}
	return time.Since(start)
}

// custodyConsume reads n messages through the adapter and the runtime with
// a handler working for work, at the given concurrency and in-flight window.
func custodyConsume(b *testing.B, stream string, n, concurrency, inFlight int, work time.Duration, opts ...Option) (time.Duration, Stats) {
	b.Helper()
	e := newEnv(b)
	benchConsumer(b, e, stream)
	src, err := New(context.Background(), e.js, stream, "bench", opts...)
	if err != nil {
		b.Fatal(err)
	}
	var count atomic.Int64
	done := make(chan struct{})
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if work > 0 {
			time.Sleep(work)
		}
		if count.Add(1) == int64(n) {
			close(done)
		}
		return nil
	})
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	copts := []consumer.Option{consumer.WithConcurrency(concurrency), consumer.WithLogger(quiet)}
	if inFlight > 0 {
		copts = append(copts, consumer.WithMaxInFlight(inFlight))
	}
	c, err := consumer.New(src, h, copts...)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	start := time.Now()
	go func() { ran <- c.Run(ctx) }()
	<-done
	// Done once every ack is answered (or, unconfirmed, flushed and
	// processed): the runtime acks after the handler.
	for src.Stats().Acks < int64(n) {
		time.Sleep(100 * time.Microsecond)
	}
	if src.opts.unconfirmedAcks {
		waitAcked(b, e, stream)
	}
	took := time.Since(start)
	cancel()
	if err := <-ran; err != nil {
		b.Fatal(err)
	}
	return took, src.Stats()
}

// watermillConsume reads n messages through Watermill's JetStream
// subscriber (watermill-nats/v2) bound to the same kind of durable consumer,
// acking each; ackAsync picks its fire-and-forget ack over its default, the
// acknowledged one.
func watermillConsume(b *testing.B, stream string, n int, ackAsync bool) time.Duration {
	b.Helper()
	e := newEnv(b)
	benchConsumer(b, e, stream)
	sub, err := wmjs.NewSubscriber(wmjs.SubscriberConfig{
		Conn:   e.nc,
		Logger: watermill.NopLogger{},
		ResourceInitializer: wmjs.ExistingConsumer(func(string, string) jetstream.ConsumerConfig {
			return jetstream.ConsumerConfig{Name: "bench"}
		}, ""),
		AckAsync: ackAsync,
	})
	if err != nil {
		b.Fatal(err)
	}
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
	// Watermill acks after the channel hand-off: wait until the server has
	// every ack.
	waitAcked(b, e, stream)
	took := time.Since(start)
	cancel()
	sub.Close()
	return took
}

// waitAcked waits until the bench consumer of stream has nothing pending
// or unacked.
func waitAcked(b *testing.B, e *env, stream string) {
	b.Helper()
	c, err := e.js.Consumer(e.ctx(), stream, "bench")
	if err != nil {
		b.Fatal(err)
	}
	for {
		ci, err := c.Info(e.ctx())
		if err != nil {
			b.Fatal(err)
		}
		if ci.NumAckPending == 0 && ci.NumPending == 0 {
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// The no-op handler: the adapter under the runtime against a raw pull loop
// acking each message (fire-and-forget, and acknowledged), and against
// Watermill's subscriber, each on a fresh stream with the same contents.
func BenchmarkNoop(b *testing.B) {
	for _, tc := range []struct {
		name                  string
		concurrency, inFlight int
		opts                  []Option
	}{
		{"c64", 64, 0, nil},
		{"c64-inflight512", 64, 512, nil},
		{"c64-inflight512-fetch256", 64, 512, []Option{WithMaxFetch(256)}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			e := newEnv(b)
			var raw, rawNoWait, rawDouble, wm, cust time.Duration
			var acks, renewals, fetches, received int64
			var rawAllocs, custAllocs uint64
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				var s [5]string
				for k := range s {
					s[k] = benchStream(b, e, benchMessages)
				}
				b.StartTimer()
				// Alternate the order: the machine is shared and its load
				// drifts; over several iterations it falls on every side.
				sides := []func(){
					func() { raw += rawConsume(b, s[0], benchMessages, false, false) },
					func() {
						m0 := mallocs()
						rawNoWait += rawConsume(b, s[1], benchMessages, true, false)
						rawAllocs += mallocs() - m0
					},
					func() { rawDouble += rawConsume(b, s[2], benchMessages, true, true) },
					func() { wm += watermillConsume(b, s[3], benchMessages, false) },
					func() {
						m0 := mallocs()
						took, st := custodyConsume(b, s[4], benchMessages, tc.concurrency, tc.inFlight, 0, tc.opts...)
						custAllocs += mallocs() - m0
						cust += took
						acks += st.Acks
						renewals += st.Renewals
						fetches += st.Fetches
						received += st.Received
					},
				}
				for j := range sides {
					sides[(i+j)%len(sides)]()
				}
			}
			total := float64(benchMessages * b.N)
			b.ReportMetric(total/raw.Seconds(), "raw-msg/s")
			b.ReportMetric(total/rawNoWait.Seconds(), "rawnowait-msg/s")
			b.ReportMetric(total/rawDouble.Seconds(), "rawdouble-msg/s")
			b.ReportMetric(total/wm.Seconds(), "watermill-msg/s")
			b.ReportMetric(total/cust.Seconds(), "custody-msg/s")
			b.ReportMetric(raw.Seconds()/cust.Seconds(), "x-raw")
			b.ReportMetric(rawNoWait.Seconds()/cust.Seconds(), "x-rawnowait")
			b.ReportMetric(rawDouble.Seconds()/cust.Seconds(), "x-rawdouble")
			b.ReportMetric(wm.Seconds()/cust.Seconds(), "x-watermill")
			b.ReportMetric(float64(acks)/float64(received), "acks/msg")
			b.ReportMetric(float64(renewals)/float64(received), "renewals/msg")
			b.ReportMetric(float64(fetches)/float64(received), "fetches/msg")
			b.ReportMetric(float64(rawAllocs)/total, "raw-allocs/msg")
			b.ReportMetric(float64(custAllocs)/total, "custody-allocs/msg")
		})
	}
}

// What the acknowledged ack costs: the same consumer with acks confirmed by
// the server's reply (as shipped) and fire-and-forget, on fresh streams of
// the same contents, concurrency 64, 512 held, pulls of 256.
func BenchmarkAckConfirmation(b *testing.B) {
	e := newEnv(b)
	var confirmed, unconfirmed time.Duration
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		s1, s2 := benchStream(b, e, benchMessages), benchStream(b, e, benchMessages)
		b.StartTimer()
		runConfirmed := func() {
			took, _ := custodyConsume(b, s1, benchMessages, 64, 512, 0, WithMaxFetch(256))
			confirmed += took
		}
		if i%2 == 1 {
			runConfirmed()
		}
		took, _ := custodyConsume(b, s2, benchMessages, 64, 512, 0, WithMaxFetch(256), func(o *options) error { o.unconfirmedAcks = true; return nil })
		unconfirmed += took
		if i%2 == 0 {
			runConfirmed()
		}
	}
	total := float64(benchMessages * b.N)
	b.ReportMetric(total/confirmed.Seconds(), "confirmed-msg/s")
	b.ReportMetric(total/unconfirmed.Seconds(), "unconfirmed-msg/s")
	b.ReportMetric(unconfirmed.Seconds()/confirmed.Seconds(), "ratio")
}

// A 1 ms handler at concurrency 64 against concurrency 1, both with the
// runtime's default in-flight window (twice the concurrency, at least 20),
// and with concurrency 64 holding 256.
func BenchmarkSlowHandlerConcurrency64VersusOne(b *testing.B) {
	for _, tc := range []struct {
		name     string
		inFlight int
	}{
		{"default", 0},
		{"c64-inflight256", 256},
	} {
		b.Run(tc.name, func(b *testing.B) { benchSpeedup(b, tc.inFlight) })
	}
}

func benchSpeedup(b *testing.B, inFlight64 int) {
	e := newEnv(b)
	const n1, n64 = 1000, 30000
	var one, many time.Duration
	var acks, renewals, received int64
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		s1, s64 := benchStream(b, e, n1), benchStream(b, e, n64)
		b.StartTimer()
		run64 := func() {
			took, st := custodyConsume(b, s64, n64, 64, inFlight64, time.Millisecond)
			many += took
			acks += st.Acks
			renewals += st.Renewals
			received += st.Received
		}
		if i%2 == 1 {
			run64()
		}
		t1, _ := custodyConsume(b, s1, n1, 1, 0, time.Millisecond)
		one += t1
		if i%2 == 0 {
			run64()
		}
	}
	r1 := float64(n1*b.N) / one.Seconds()
	r64 := float64(n64*b.N) / many.Seconds()
	b.ReportMetric(r1, "c1-msg/s")
	b.ReportMetric(r64, "c64-msg/s")
	b.ReportMetric(r64/r1, "speedup")
	b.ReportMetric(float64(acks)/float64(received), "acks/msg")
	b.ReportMetric(float64(renewals)/float64(received), "renewals/msg")
}

// A handler outliving a third of AckWait, so every message is renewed: the
// renewals' cost per message.
func BenchmarkRenewals(b *testing.B) {
	e := newEnv(b)
	const n = 512
	var renewals, received int64
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		s := benchStream(b, e, n)
		if _, err := e.js.CreateOrUpdateConsumer(e.ctx(), s, jetstream.ConsumerConfig{Durable: "bench", AckPolicy: jetstream.AckExplicitPolicy, AckWait: 3 * time.Second}); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		_, st := custodyConsumeAckWait(b, s, n, 256, 1500*time.Millisecond)
		renewals += st.Renewals
		received += st.Received
	}
	b.ReportMetric(float64(renewals)/float64(received), "renewals/msg")
}

// custodyConsumeAckWait is custodyConsume on the bench consumer as it is
// (BenchmarkRenewals gives it a short AckWait).
func custodyConsumeAckWait(b *testing.B, stream string, n, concurrency int, work time.Duration) (time.Duration, Stats) {
	b.Helper()
	e := newEnv(b)
	src, err := New(context.Background(), e.js, stream, "bench")
	if err != nil {
		b.Fatal(err)
	}
	var count atomic.Int64
	done := make(chan struct{})
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		time.Sleep(work)
		if count.Add(1) == int64(n) {
			close(done)
		}
		return nil
	})
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	c, err := consumer.New(src, h, consumer.WithConcurrency(concurrency), consumer.WithLogger(quiet))
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	start := time.Now()
	go func() { ran <- c.Run(ctx) }()
	<-done
	took := time.Since(start)
	cancel()
	if err := <-ran; err != nil {
		b.Fatal(fmt.Errorf("Run: %w", err))
	}
	return took, src.Stats()
}

// What the Source's declarations were chosen against: the same runs (a
// no-op handler at concurrency 64; a 1 ms handler at concurrency 1 and 64,
// default in-flight windows) as declared, without the ack linger, with two
// Receive calls at once, and with pulls of at most 32, on fresh streams of
// the same contents. Each iteration runs every variant in turn (rotating
// the order); the ratios reported are the medians, over iterations, of each
// variant's rate over the declared one's in the same iteration, which
// shrugs off the load of a shared machine better than total times do.
func BenchmarkDeclarations(b *testing.B) {
	declared := func(*options) error { return nil }
	variants := []struct {
		name string
		opt  Option
	}{
		{"declared", declared},
		{"nolinger", func(o *options) error { o.ackBatching = &adapters.Batching{}; return nil }},
		{"receivers2", func(o *options) error { o.receivers = 2; return nil }},
		{"fetch32", WithMaxFetch(32)},
	}
	const nNoop, n1, n64 = benchMessages, 1000, 20000
	e := newEnv(b)
	type rates struct{ noop, one, many []float64 }
	results := make([]rates, len(variants))
	for i := 0; i < b.N; i++ {
		for j := range variants {
			k := (i + j) % len(variants)
			v := variants[k]
			b.StopTimer()
			sNoop, s1, s64 := benchStream(b, e, nNoop), benchStream(b, e, n1), benchStream(b, e, n64)
			b.StartTimer()
			r := &results[k]
			took, _ := custodyConsume(b, sNoop, nNoop, 64, 0, 0, v.opt)
			r.noop = append(r.noop, nNoop/took.Seconds())
			took, _ = custodyConsume(b, s1, n1, 1, 0, time.Millisecond, v.opt)
			r.one = append(r.one, n1/took.Seconds())
			took, _ = custodyConsume(b, s64, n64, 64, 0, time.Millisecond, v.opt)
			r.many = append(r.many, n64/took.Seconds())
		}
	}
	base := results[0]
	for k, v := range variants {
		r := results[k]
		b.ReportMetric(median(r.noop), v.name+"-noop-msg/s")
		b.ReportMetric(median(r.one), v.name+"-1ms-c1-msg/s")
		b.ReportMetric(median(r.many), v.name+"-1ms-c64-msg/s")
		b.ReportMetric(medianRatio(r.many, r.one), v.name+"-speedup")
		if k > 0 {
			b.ReportMetric(medianRatio(r.noop, base.noop), v.name+"-noop-x-declared")
			b.ReportMetric(medianRatio(r.one, base.one), v.name+"-1ms-c1-x-declared")
			b.ReportMetric(medianRatio(r.many, base.many), v.name+"-1ms-c64-x-declared")
		}
	}
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// medianRatio is the median of a[i]/b[i].
func medianRatio(a, b []float64) float64 {
	r := make([]float64, len(a))
	for i := range a {
		r[i] = a[i] / b[i]
	}
	return median(r)
}
