package rabbitmq

import (
	"context"
	"log/slog"
	"net"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/consumer"
)

// Benchmarks against the raw client on the same broker, in the same run,
// reported as ratios. Each iteration fills a fresh queue with the same
// messages (256-byte persistent bodies) and consumes all of them; only the
// consuming is timed. Run with a fixed, small count, for example:
//
//	go test -run '^$' -bench . -benchtime 1x -count 1 ./adapters/rabbitmq/

const benchPrefetch = 256

func benchFill(b *testing.B, a *admin, q string, n int) {
	b.Helper()
	body := make([]byte, 256)
	for i := range body {
		body[i] = byte('a' + i%26)
	}
	var last *amqp.DeferredConfirmation
	for i := 0; i < n; i++ {
		dc, err := a.ch.PublishWithDeferredConfirm("", q, false, false, amqp.Publishing{Body: body, DeliveryMode: amqp.Persistent})
		if err != nil {
			b.Fatal(err)
		}
		last = dc
	}
	if last != nil && !last.Wait() {
		b.Fatal("fill not confirmed")
	}
	deadline := time.Now().Add(time.Minute)
	for a.ready(q) != n {
		if time.Now().After(deadline) {
			b.Fatalf("queue holds %d of %d", a.ready(q), n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// mallocs returns the number of heap allocations so far.
func mallocs() uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.Mallocs
}

// rawConsume consumes n messages with plain amqp091, acking each one on its
// own, and returns the time it took.
func rawConsume(b *testing.B, q string, n int) time.Duration {
	b.Helper()
	conn, err := amqp.Dial(brokerURL)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		b.Fatal(err)
	}
	if err := ch.Qos(benchPrefetch, 0, false); err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	msgs, err := ch.Consume(q, "", false, false, false, false, nil)
	if err != nil {
		b.Fatal(err)
	}
	got := 0
	for m := range msgs {
		if err := m.Ack(false); err != nil {
			b.Fatal(err)
		}
		if got++; got == n {
			break
		}
	}
	return time.Since(start)
}

// custodyConsume consumes n messages through the adapter and the runtime
// with handler h at the given concurrency, and returns the time it took and
// the adapter's stats.
func custodyConsume(b *testing.B, q string, n, concurrency int, work time.Duration) (time.Duration, Stats) {
	b.Helper()
	quiet := slog.New(slog.DiscardHandler)
	src, err := New(context.Background(), q, WithURL(brokerURL), WithPrefetch(max(benchPrefetch, concurrency)), WithLogger(quiet))
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
		b.Fatal(err)
	}
	return took, src.Stats()
}

// The no-op handler: throughput of the adapter under the runtime against a
// raw amqp091 consumer that acks each message on its own, same prefetch,
// same queue contents; and the ack frames the adapter wrote per message.
func BenchmarkNoopVersusRawPerMessageAck(b *testing.B) {
	const n = 10000
	a := newAdmin(b)
	var raw, cust time.Duration
	var frames, multiple, acked, rawAllocs, custAllocs uint64
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		q1 := a.queue(ClassicQueue, nil)
		benchFill(b, a, q1, n)
		q2 := a.queue(ClassicQueue, nil)
		benchFill(b, a, q2, n)
		b.StartTimer()
		// Alternate which goes first: the machine is shared and its load
		// drifts; over several iterations the drift falls on both sides.
		if i%2 == 1 {
			m0 := mallocs()
			raw += rawConsume(b, q1, n)
			rawAllocs += mallocs() - m0
		}
		m0 := mallocs()
		took, st := custodyConsume(b, q2, n, 4, 0)
		custAllocs += mallocs() - m0
		if i%2 == 0 {
			m0 := mallocs()
			raw += rawConsume(b, q1, n)
			rawAllocs += mallocs() - m0
		}
		cust += took
		frames += st.AckFrames
		multiple += st.MultipleAcks
		acked += st.Acked
	}
	total := float64(n * b.N)
	b.ReportMetric(total/raw.Seconds(), "raw-msg/s")
	b.ReportMetric(total/cust.Seconds(), "custody-msg/s")
	b.ReportMetric(raw.Seconds()/cust.Seconds(), "ratio")
	b.ReportMetric(float64(frames)/float64(acked), "ackframes/msg")
	b.ReportMetric(float64(multiple)/float64(acked), "multiacks/msg")
	b.ReportMetric(float64(rawAllocs)/total, "raw-allocs/msg")
	b.ReportMetric(float64(custAllocs)/total, "custody-allocs/msg")
}

// A 1 ms handler at concurrency 64 against concurrency 1: the speed-up the
// runtime's workers get over one RabbitMQ channel. On a small machine 64
// workers at 1 ms reach the broker's own no-op ceiling, which then bounds the
// speed-up; the 10 ms variant stays below it and shows the scaling itself.
func BenchmarkSlowHandlerConcurrency64VersusOne(b *testing.B) {
	// Enough messages for each side to run about a second on its own; a
	// fraction of that would measure start-up rather than throughput.
	benchSpeedup(b, time.Millisecond, 1000, 20000)
}

func BenchmarkSlowHandler10msConcurrency64VersusOne(b *testing.B) {
	benchSpeedup(b, 10*time.Millisecond, 150, 6400)
}

func benchSpeedup(b *testing.B, work time.Duration, n1, n64 int) {
	a := newAdmin(b)
	var one, many time.Duration
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		q1 := a.queue(ClassicQueue, nil)
		benchFill(b, a, q1, n1)
		q64 := a.queue(ClassicQueue, nil)
		benchFill(b, a, q64, n64)
		b.StartTimer()
		if i%2 == 1 {
			t64, _ := custodyConsume(b, q64, n64, 64, work)
			many += t64
		}
		t1, _ := custodyConsume(b, q1, n1, 1, work)
		one += t1
		if i%2 == 0 {
			t64, _ := custodyConsume(b, q64, n64, 64, work)
			many += t64
		}
	}
	r1 := float64(n1*b.N) / one.Seconds()
	r64 := float64(n64*b.N) / many.Seconds()
	b.ReportMetric(r1, "c1-msg/s")
	b.ReportMetric(r64, "c64-msg/s")
	b.ReportMetric(r64/r1, "speedup")
}

// The duplicate window after a crash: a consumer at concurrency 8 whose
// handlers mostly take a millisecond and sometimes (one in 50) 100 ms is
// killed four times mid-stream (its socket closed without a word, as the
// kernel does for a killed process); the adapter reconnects and the broker
// redelivers what it holds unacked. Every effect completed before the kill
// whose ack had not reached the broker runs again. Reported per kill: the
// effects repeated, and the handlers running at the kill (which repeat
// whatever the acks do).
func BenchmarkRepeatsPerCrash(b *testing.B) {
	const (
		n     = 3000
		kills = 4
	)
	a := newAdmin(b)
	var repeats, running, frames, acked uint64
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		q := a.queue(ClassicQueue, nil)
		for i := 0; i < n; i++ {
			p := amqp.Publishing{MessageId: strconv.Itoa(i), Body: make([]byte, 256), DeliveryMode: amqp.Persistent}
			if i%50 == 49 {
				p.Headers = amqp.Table{"slow": "1"}
			}
			a.publishMsg(q, p)
		}
		b.StartTimer()
		var (
			mu   sync.Mutex
			conn net.Conn
		)
		dial := func(network, addr string) (net.Conn, error) {
			c, err := net.Dial(network, addr)
			if err == nil {
				mu.Lock()
				conn = c
				mu.Unlock()
			}
			return c, err
		}
		quiet := slog.New(slog.DiscardHandler)
		src, err := New(context.Background(), q, WithURL(brokerURL), WithPrefetch(benchPrefetch), WithLogger(quiet),
			WithConfig(amqp.Config{Dial: dial}), WithReconnectBackoff(10*time.Millisecond, 100*time.Millisecond))
		if err != nil {
			b.Fatal(err)
		}
		var (
			effects  sync.Map // body -> *atomic.Int64
			distinct atomic.Int64
			total    atomic.Int64
			inFlight atomic.Int64
		)
		h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			inFlight.Add(1)
			defer inFlight.Add(-1)
			work := time.Millisecond
			if m.Headers["slow"] == "1" {
				work = 100 * time.Millisecond
			}
			time.Sleep(work)
			c, _ := effects.LoadOrStore(m.ID, new(atomic.Int64))
			if c.(*atomic.Int64).Add(1) == 1 {
				distinct.Add(1)
			}
			total.Add(1)
			return nil
		})
		c, err := consumer.New(src, h, consumer.WithConcurrency(8), consumer.WithLogger(quiet))
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		ran := make(chan error, 1)
		go func() { ran <- c.Run(ctx) }()
		for k := 1; k <= kills; k++ {
			for distinct.Load() < int64(k*n/(kills+1)) {
				time.Sleep(time.Millisecond)
			}
			gens := src.Stats().Generations
			running += uint64(inFlight.Load())
			mu.Lock()
			_ = conn.Close()
			mu.Unlock()
			for src.Stats().Generations == gens {
				time.Sleep(time.Millisecond)
			}
		}
		for distinct.Load() < n {
			time.Sleep(time.Millisecond)
		}
		// Redeliveries of messages already handled may still be on their
		// way: wait for the broker to hold nothing.
		waitUnacked(b, q, 0)
		for a.ready(q) != 0 {
			time.Sleep(10 * time.Millisecond)
		}
		waitUnacked(b, q, 0)
		cancel()
		if err := <-ran; err != nil {
			b.Fatal(err)
		}
		st := src.Stats()
		frames += st.AckFrames
		acked += st.Acked
		repeats += uint64(total.Load() - n)
	}
	b.ReportMetric(float64(repeats)/float64(kills*b.N), "repeats/kill")
	b.ReportMetric(float64(running)/float64(kills*b.N), "running/kill")
	b.ReportMetric(float64(frames)/float64(acked), "ackframes/msg")
}
