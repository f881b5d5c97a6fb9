package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/teststores"
)

// startBatch runs a batch consumer of src with h until the returned stop
// is called.
func startBatch(t testing.TB, src adapters.Source, h consumer.BatchHandler, opts ...consumer.Option) (stop func()) {
	t.Helper()
	opts = append([]consumer.Option{consumer.WithLogger(quiet)}, opts...)
	c, err := consumer.NewBatch(src, h, opts...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	return func() {
		cancel()
		// A source crashed under the consumer (memory.Source.Crash) ends
		// a Receive under way with ErrClosed: that Run ends so.
		if err := <-done; err != nil && !errors.Is(err, adapters.ErrClosed) {
			t.Errorf("Run: %v", err)
		}
	}
}

// Through the runtime, bulk effects run once per message although a third
// of the messages are published twice (in one batch or in two), a consumer
// is killed holding a batch's claims (which it abandons: its store calls
// stop, as after SIGKILL), some messages fail their first attempt, and one
// always fails: that one alone is dead-lettered, once.
func TestBatchEffectsRunOnceAcrossDuplicatesAndACrash(t *testing.T) {
	for _, st := range teststores.All() {
		t.Run(st.Name, func(t *testing.T) {
			const n = 60
			b := memory.NewBroker()
			for _, q := range []string{"q", "dlq"} {
				if err := b.CreateQueue(q, memory.QueueOptions{Lease: crashHandover}); err != nil {
					t.Fatal(err)
				}
			}
			for i := range n {
				m := memory.Message{ID: fmt.Sprint("job-", i), Body: []byte(fmt.Sprint(i))}
				copies := 1 + (i%3)/2 // every third message twice
				for range copies {
					if err := b.Publish(context.Background(), "q", m); err != nil {
						t.Fatal(err)
					}
				}
			}
			dlq, err := b.DeadLetterQueue("dlq")
			if err != nil {
				t.Fatal(err)
			}
			store := st.New(t)
			m := newMeter(t)
			// The claims outlive the broker's hand-over, so the killed
			// consumer's messages come back while it still holds their
			// keys: overlapping duplicates, deferred until the claims run
			// out.
			opts := []idempotency.Option{idempotency.WithMeterProvider(m), idempotency.WithLogger(quiet),
				idempotency.WithLease(2 * crashHandover), idempotency.WithOverlapRetryDelay(100 * time.Millisecond)}

			doomed := &killableStore{Store: store}
			holding, killed := make(chan struct{}), make(chan struct{})
			var once sync.Once
			src1, err := b.Source("q", memory.WithPollWait(20*time.Millisecond))
			if err != nil {
				t.Fatal(err)
			}
			stop1 := startBatch(t, src1, newBatchGuard(t, doomed, func(ctx context.Context, _ *consumer.Batch) error {
				once.Do(func() { close(holding) })
				<-killed
				return errKilled
			}, opts...), consumer.WithBatchSize(20))
			<-holding
			src1.Crash()
			doomed.dead.Store(true)
			close(killed)
			stop1()

			var (
				mu      sync.Mutex
				effects = map[string]int{}
				tries   = map[string]int{}
			)
			src2, err := b.Source("q", memory.WithPollWait(20*time.Millisecond))
			if err != nil {
				t.Fatal(err)
			}
			stop2 := startBatch(t, src2, newBatchGuard(t, store, func(_ context.Context, batch *consumer.Batch) error {
				mu.Lock()
				defer mu.Unlock()
				for _, msg := range batch.Messages {
					tries[msg.ID]++
					switch {
					case msg.ID == "job-7":
						batch.Fail(msg, consumer.Permanent(errors.New("cannot parse")))
					case msg.ID[len(msg.ID)-1] == '5' && tries[msg.ID] == 1:
						batch.Fail(msg, errors.New("not yet"))
					default:
						effects[msg.ID]++ // the bulk insert
						batch.Done(msg)
					}
				}
				return nil
			}, opts...), consumer.WithBatchSize(20), consumer.WithConcurrency(2), consumer.WithDeadLetter(dlq),
				// The memory broker counts deliveries, and each deferral of
				// an overlapping duplicate raises the count (see
				// consumer.Defer): MaxAttempts leaves room for them.
				consumer.WithRetry(consumer.Retry{MaxAttempts: 100, Backoff: consumer.ConstantBackoff(20 * time.Millisecond)}))
			wctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			err = b.WaitEmpty(wctx, "q")
			stop2()
			if err != nil {
				t.Fatalf("the queue did not drain: %v", err)
			}

			mu.Lock()
			defer mu.Unlock()
			for i := range n {
				id := fmt.Sprint("job-", i)
				want := 1
				if id == "job-7" {
					want = 0
				}
				if effects[id] != want {
					t.Errorf("the effect of %s ran %d times, want %d", id, effects[id], want)
				}
			}
			dl, err := b.Messages("dlq")
			if err != nil {
				t.Fatal(err)
			}
			if len(dl) != 1 || dl[0].ID != "job-7" {
				t.Fatalf("dead letters %v, want job-7 alone", dl)
			}
			if m.overlapping(t) == 0 || m.sequential(t) == 0 {
				t.Fatalf("overlapping %d, sequential %d: the crash or the duplicates did not bite", m.overlapping(t), m.sequential(t))
			}
		})
	}
}

// A store that cannot be reached under a batch consumer dead-letters
// nothing: every message waits without using up an attempt, and every
// effect runs once the store is back.
func TestBatchStoreOutageDeadLettersNothing(t *testing.T) {
	for _, st := range linkedStores() {
		t.Run(st.name, func(t *testing.T) {
			const (
				n           = 20
				maxAttempts = 3
			)
			store, link := st.new(t)
			link.Cut()
			b := memory.NewBroker()
			for _, q := range []string{"q", "dlq"} {
				if err := b.CreateQueue(q, memory.QueueOptions{Lease: time.Second}); err != nil {
					t.Fatal(err)
				}
			}
			for i := range n {
				if err := b.Publish(context.Background(), "q", memory.Message{ID: fmt.Sprint("order-", i), Body: []byte("x")}); err != nil {
					t.Fatal(err)
				}
			}
			dlq, err := b.DeadLetterQueue("dlq")
			if err != nil {
				t.Fatal(err)
			}
			var (
				mu       sync.Mutex
				runs     = map[string]int{}
				attempts []int
			)
			m := newMeter(t)
			h := newBatchGuard(t, store, func(_ context.Context, batch *consumer.Batch) error {
				mu.Lock()
				defer mu.Unlock()
				for _, msg := range batch.Messages {
					runs[msg.ID]++
					attempts = append(attempts, msg.Attempt)
				}
				batch.DoneAll()
				return nil
			}, idempotency.WithMeterProvider(m), idempotency.WithLogger(quiet))
			src, err := b.Source("q", memory.WithPollWait(20*time.Millisecond))
			if err != nil {
				t.Fatal(err)
			}
			stop := startBatch(t, src, h, consumer.WithBatchSize(8), consumer.WithConcurrency(2), consumer.WithDeadLetter(dlq),
				consumer.WithRetry(consumer.Retry{MaxAttempts: maxAttempts, Backoff: consumer.ConstantBackoff(5 * time.Millisecond)}))
			defer stop()

			deadLettered := func() int {
				s, err := b.Stats("dlq")
				if err != nil {
					t.Fatal(err)
				}
				return s.Visible
			}
			eventually(t, "the claims fail far past MaxAttempts", func() bool {
				return deadLettered() > 0 || m.count(t, idempotency.MetricStoreErrors, "custody.idempotency.op", "claim") >= 2*n*maxAttempts
			})
			if k := deadLettered(); k > 0 {
				t.Fatalf("%d of %d valid messages dead-lettered while the store was down", k, n)
			}
			link.Restore()
			wctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := b.WaitEmpty(wctx, "q"); err != nil {
				t.Fatalf("the queue did not drain once the store was back: %v", err)
			}
			if k := deadLettered(); k > 0 {
				t.Fatalf("%d of %d valid messages dead-lettered", k, n)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(runs) != n {
				t.Fatalf("%d of %d effects ran", len(runs), n)
			}
			for id, k := range runs {
				if k != 1 {
					t.Errorf("the effect of %s ran %d times, want once", id, k)
				}
			}
			for _, a := range attempts {
				if a != 1 {
					t.Fatalf("a handler saw Attempt %d, want 1: the outage used up attempts", a)
				}
			}
		})
	}
}
