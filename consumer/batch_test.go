package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// runBatch runs a batch consumer on src, stopped when the test ends.
func runBatch(t *testing.T, src adapters.Source, h consumer.BatchHandlerFunc, opts ...consumer.Option) *running {
	t.Helper()
	opts = append([]consumer.Option{consumer.WithLogger(testlog.New(t))}, opts...)
	c, err := consumer.NewBatch(src, h, opts...)
	if err != nil {
		t.Fatalf("NewBatch: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{cancel: cancel, done: make(chan error, 1), t: t}
	go func() { r.done <- c.Run(ctx) }()
	t.Cleanup(func() { r.stop() })
	return r
}

// batchLog records what a batch handler saw.
type batchLog struct {
	mu      sync.Mutex
	sizes   []int
	calls   map[string]int
	bodies  []string // in the order handled
	largest int
}

func newBatchLog() *batchLog { return &batchLog{calls: map[string]int{}} }

func (l *batchLog) saw(b *consumer.Batch) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sizes = append(l.sizes, len(b.Messages))
	l.largest = max(l.largest, len(b.Messages))
	for _, m := range b.Messages {
		l.calls[string(m.Body)]++
		l.bodies = append(l.bodies, string(m.Body))
	}
}

func (l *batchLog) count(body string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.calls[body]
}

func TestBatchHandlerAcksEveryMessageOnce(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	const n = 250
	for i := range n {
		e.publish(strconv.Itoa(i))
	}
	l := newBatchLog()
	runBatch(t, e.source(), func(ctx context.Context, b *consumer.Batch) error {
		l.saw(b)
		b.DoneAll()
		return nil
	}, consumer.WithBatchSize(100))
	if err := e.b.WaitEmpty(context.Background(), "q"); err != nil {
		t.Fatal(err)
	}
	if l.largest > 100 {
		t.Fatalf("a batch of %d messages, want at most 100", l.largest)
	}
	for i := range n {
		if c := l.count(strconv.Itoa(i)); c != 1 {
			t.Fatalf("message %d handled %d times, want once", i, c)
		}
	}
	if s := e.stats("q"); s.Acked != n {
		t.Fatalf("%d acked, want %d", s.Acked, n)
	}
}

// Each message keeps its own fate: a failed one is retried with its own
// attempt count, a permanent one dead-lettered with its diagnostics, a
// forgotten one is not acked but retried, and the others are acked.
func TestBatchOutcomesPerMessage(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("ok", "flaky", "poison", "forgotten")
	var mu sync.Mutex
	attempts := map[string][]int{}
	runBatch(t, e.source(), func(ctx context.Context, b *consumer.Batch) error {
		for _, m := range b.Messages {
			mu.Lock()
			attempts[string(m.Body)] = append(attempts[string(m.Body)], m.Attempt)
			first := len(attempts[string(m.Body)]) == 1
			mu.Unlock()
			switch string(m.Body) {
			case "flaky":
				if first {
					b.Fail(m, errors.New("try again"))
					continue
				}
			case "poison":
				b.Fail(m, consumer.Permanent(errors.New("cannot parse")))
				continue
			case "forgotten":
				if first {
					continue // no outcome: must not be acked
				}
			}
			b.Done(m)
		}
		return nil
	}, fastRetry(3), consumer.WithDeadLetter(e.dlq()))
	if err := e.b.WaitEmpty(context.Background(), "q"); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if got := fmt.Sprint(attempts["flaky"]); got != "[1 2]" {
		t.Errorf("flaky attempts %s, want [1 2]", got)
	}
	if got := fmt.Sprint(attempts["forgotten"]); got != "[1 2]" {
		t.Errorf("forgotten attempts %s, want [1 2]: a message without an outcome was acked", got)
	}
	if got := fmt.Sprint(attempts["ok"]); got != "[1]" {
		t.Errorf("ok attempts %s, want [1]", got)
	}
	dl, err := e.b.Messages("dlq")
	if err != nil {
		t.Fatal(err)
	}
	if len(dl) != 1 || string(dl[0].Body) != "poison" || dl[0].Headers[adapters.HeaderAttempts] != "1" || dl[0].Headers[adapters.HeaderPermanent] != "true" {
		t.Fatalf("dead letters %+v, want poison alone, permanent after 1 attempt", dl)
	}
}

// A batch handler's error fails every message of the batch, whatever
// outcomes it recorded first; a panic likewise.
func TestBatchErrorFailsTheWholeBatch(t *testing.T) {
	for _, how := range []string{"error", "panic"} {
		t.Run(how, func(t *testing.T) {
			e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
			e.publish("a", "b", "c")
			l := newBatchLog()
			var calls atomic.Int32
			runBatch(t, e.source(), func(ctx context.Context, b *consumer.Batch) error {
				l.saw(b)
				b.DoneAll()
				if calls.Add(1) == 1 {
					if how == "panic" {
						panic("bulk write blew up")
					}
					return errors.New("bulk write failed")
				}
				return nil
			}, fastRetry(3), consumer.WithBatchLinger(50*time.Millisecond))
			if err := e.b.WaitEmpty(context.Background(), "q"); err != nil {
				t.Fatal(err)
			}
			for _, body := range []string{"a", "b", "c"} {
				if c := l.count(body); c != 2 {
					t.Errorf("%s handled %d times, want twice: the failed batch's outcomes counted", body, c)
				}
			}
		})
	}
}

// ackRecorder records the bodies acked, in the order of the Ack calls.
type ackRecorder struct {
	*memory.Source
	mu    sync.Mutex
	acked []string
}

func (s *ackRecorder) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	s.mu.Lock()
	for _, d := range ds {
		s.acked = append(s.acked, string(d.Body))
	}
	s.mu.Unlock()
	return s.Source.Ack(ctx, ds)
}

// Within a batch, the messages of one ordering key come in order; when one
// fails, the key's later messages of the batch are not acked ahead of it:
// they run again after it, in order.
func TestBatchKeepsALanesOrderAfterAFailure(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publishKeyed("a", "a1", "a2", "a3", "a4", "a5")
	e.publishKeyed("b", "b1", "b2")
	src := &ackRecorder{Source: e.source()}
	l := newBatchLog()
	var a3Failed atomic.Bool
	runBatch(t, src, func(ctx context.Context, b *consumer.Batch) error {
		l.saw(b)
		var prev string
		for _, m := range b.Messages {
			body := string(m.Body)
			if prev != "" && prev[0] == body[0] && prev >= body {
				t.Errorf("batch holds %s after %s: a key's messages out of order", body, prev)
			}
			prev = body
			if body == "a3" && a3Failed.CompareAndSwap(false, true) {
				b.Fail(m, errors.New("a3 not yet"))
				continue
			}
			b.Done(m)
		}
		return nil
	}, consumer.WithOrdering(consumer.OrderByKey), fastRetry(3), consumer.WithBatchLinger(20*time.Millisecond))
	if err := e.b.WaitEmpty(context.Background(), "q"); err != nil {
		t.Fatal(err)
	}
	src.mu.Lock()
	defer src.mu.Unlock()
	var a []string
	for _, body := range src.acked {
		if strings.HasPrefix(body, "a") {
			a = append(a, body)
		}
	}
	if got := fmt.Sprint(a); got != "[a1 a2 a3 a4 a5]" {
		t.Fatalf("key a acked in the order %s, want [a1 a2 a3 a4 a5]", got)
	}
	if l.count("a4") < 2 || l.count("a5") < 2 {
		t.Fatalf("a4 handled %d times, a5 %d: the messages after the failed one were not run again after it", l.count("a4"), l.count("a5"))
	}
}

// Every message of a batch keeps its lease while the batch runs.
func TestBatchKeepsItsLeasesAlive(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 300 * time.Millisecond})
	e.publish("a", "b", "c")
	var calls atomic.Int32
	runBatch(t, e.source(), func(ctx context.Context, b *consumer.Batch) error {
		calls.Add(1)
		select {
		case <-time.After(time.Second): // over three leases
		case <-ctx.Done():
			return ctx.Err()
		}
		b.DoneAll()
		return nil
	}, consumer.WithBatchLinger(100*time.Millisecond))
	if err := e.b.WaitEmpty(context.Background(), "q"); err != nil {
		t.Fatal(err)
	}
	if s := e.stats("q"); s.Received != 3 || s.Extended == 0 {
		t.Fatalf("stats %+v, want three receives and renewals: a lease ran out under the batch", s)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("%d batches, want 1", n)
	}
}

// A dependency outage reported for one message of a batch uses up none of
// its attempts; the message waits and runs again once the dependency is
// back.
func TestBatchUnavailableUsesUpNoAttempt(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("m")
	var calls atomic.Int32
	runBatch(t, e.source(), func(ctx context.Context, b *consumer.Batch) error {
		for _, m := range b.Messages {
			if calls.Add(1) <= 6 {
				b.Fail(m, consumer.Unavailable(errors.New("store down")))
				continue
			}
			b.Done(m)
		}
		return nil
	}, fastRetry(2), consumer.WithDeadLetter(e.dlq()))
	if err := e.b.WaitEmpty(context.Background(), "q"); err != nil {
		t.Fatal(err)
	}
	if n := e.stats("dlq").Visible; n != 0 {
		t.Fatalf("%d dead letters: an outage used up attempts", n)
	}
}

func TestBatchBytesBoundsABatch(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	for range 10 {
		e.publish(strings.Repeat("x", 100))
	}
	l := newBatchLog()
	runBatch(t, e.source(), func(ctx context.Context, b *consumer.Batch) error {
		l.saw(b)
		b.DoneAll()
		return nil
	}, consumer.WithBatchBytes(250), consumer.WithBatchLinger(20*time.Millisecond))
	if err := e.b.WaitEmpty(context.Background(), "q"); err != nil {
		t.Fatal(err)
	}
	if l.largest > 2 {
		t.Fatalf("a batch of %d messages of 100 bytes under a bound of 250", l.largest)
	}
}

func TestBatchOptionsNeedABatchHandler(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{})
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	if _, err := consumer.New(e.source(), h, consumer.WithBatchSize(10)); err == nil || !strings.Contains(err.Error(), "WithBatchSize") {
		t.Fatalf("New with WithBatchSize: %v, want an error naming the option", err)
	}
	bh := consumer.BatchHandlerFunc(func(context.Context, *consumer.Batch) error { return nil })
	if _, err := consumer.NewBatch(e.source(), bh, consumer.WithAtMostOnceAckBeforeProcessingUnsafe()); err == nil {
		t.Fatal("NewBatch in at-most-once mode: nil error")
	}
	if _, err := consumer.NewBatch(e.source(), nil); err == nil {
		t.Fatal("NewBatch with a nil handler: nil error")
	}
	if _, err := consumer.NewBatch(e.source(), consumer.ChainBatch(bh, nil)); err == nil {
		t.Fatal("NewBatch with a nil middleware: nil error")
	}
}
