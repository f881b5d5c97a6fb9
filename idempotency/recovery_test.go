package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/teststores"
)

// killableStore is a consumer process's view of a shared store: once the
// process is killed, none of its calls reach the store, so the claims it
// holds are neither extended, completed nor released, as after a SIGKILL.
type killableStore struct {
	idempotency.Store
	dead atomic.Bool
}

var errKilled = errors.New("the process was killed")

func (s *killableStore) Claim(ctx context.Context, key, fp string, lease time.Duration) (idempotency.State, idempotency.Token, error) {
	if s.dead.Load() {
		return 0, "", errKilled
	}
	return s.Store.Claim(ctx, key, fp, lease)
}

func (s *killableStore) Complete(ctx context.Context, key string, tok idempotency.Token, retention time.Duration) error {
	if s.dead.Load() {
		return errKilled
	}
	return s.Store.Complete(ctx, key, tok, retention)
}

func (s *killableStore) Release(ctx context.Context, key string, tok idempotency.Token) error {
	if s.dead.Load() {
		return errKilled
	}
	return s.Store.Release(ctx, key, tok)
}

func (s *killableStore) Extend(ctx context.Context, key string, tok idempotency.Token, lease time.Duration) error {
	if s.dead.Load() {
		return errKilled
	}
	return s.Store.Extend(ctx, key, tok, lease)
}

// crashHandover is how long the broker takes to hand a killed consumer's
// messages to another one: the memory queue's lease (on Kafka, the
// rebalance once the group notices the member is gone).
const crashHandover = time.Second

// recoverFromCrash publishes keys messages, lets a consumer claim them all
// and kills it mid-handler, as SIGKILL would: its broker source stops
// answering and its store calls stop, so its claims are left to run out.
// A second consumer, started at the kill with the same middleware options,
// takes the messages over; recoverFromCrash returns how long after the
// kill the last of them had its effect, and fails if any effect ran twice
// or a message was dead-lettered.
func recoverFromCrash(tb testing.TB, store idempotency.Store, keys int, opts ...idempotency.Option) time.Duration {
	tb.Helper()
	b := memory.NewBroker()
	for _, q := range []string{"q", "dlq"} {
		if err := b.CreateQueue(q, memory.QueueOptions{Lease: crashHandover}); err != nil {
			tb.Fatal(err)
		}
	}
	for i := range keys {
		if err := b.Publish(context.Background(), "q", memory.Message{ID: fmt.Sprint("job-", i), Body: []byte("x")}); err != nil {
			tb.Fatal(err)
		}
	}
	dlq, err := b.DeadLetterQueue("dlq")
	if err != nil {
		tb.Fatal(err)
	}
	opts = append([]idempotency.Option{idempotency.WithLogger(quiet)}, opts...)

	// The doomed consumer: each handler holds its claim until the kill.
	doomed := &killableStore{Store: store}
	var holding sync.WaitGroup
	holding.Add(keys)
	killed := make(chan struct{})
	src1, err := b.Source("q", memory.WithPollWait(20*time.Millisecond))
	if err != nil {
		tb.Fatal(err)
	}
	c1, err := consumer.New(src1, newGuard(tb, doomed, func(ctx context.Context, _ *consumer.Message) error {
		holding.Done()
		<-killed
		return errKilled
	}, opts...), consumer.WithConcurrency(keys), consumer.WithLogger(quiet))
	if err != nil {
		tb.Fatal(err)
	}
	done1 := make(chan error, 1)
	go func() { done1 <- c1.Run(context.Background()) }()
	holding.Wait()

	src1.Crash()
	doomed.dead.Store(true)
	close(killed)
	kill := time.Now()
	<-done1

	var (
		mu      sync.Mutex
		effects = map[string]int{}
		last    time.Time
	)
	src2, err := b.Source("q", memory.WithPollWait(20*time.Millisecond))
	if err != nil {
		tb.Fatal(err)
	}
	c2, err := consumer.New(src2, newGuard(tb, store, func(_ context.Context, m *consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		effects[m.ID]++
		last = time.Now()
		return nil
	}, opts...), consumer.WithConcurrency(keys), consumer.WithLogger(quiet), consumer.WithDeadLetter(dlq))
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done2 := make(chan error, 1)
	go func() { done2 <- c2.Run(ctx) }()
	wctx, wcancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer wcancel()
	err = b.WaitEmpty(wctx, "q")
	cancel()
	if rerr := <-done2; rerr != nil {
		tb.Fatalf("Run: %v", rerr)
	}
	if err != nil {
		tb.Fatalf("the messages of the killed consumer were not all handled: %v", err)
	}
	if s, _ := b.Stats("dlq"); s.Visible != 0 {
		tb.Fatalf("%d messages dead-lettered after the crash", s.Visible)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(effects) != keys {
		tb.Fatalf("%d of %d effects ran after the crash", len(effects), keys)
	}
	for id, n := range effects {
		if n != 1 {
			tb.Fatalf("the effect of %s ran %d times", id, n)
		}
	}
	return last.Sub(kill)
}

// The claims of a consumer killed mid-handler block their keys until their
// lease runs out, and no longer: then another consumer runs every effect,
// once.
func TestCrashedConsumersClaimsRunOut(t *testing.T) {
	d := recoverFromCrash(t, newMemory(t), 8, idempotency.WithLease(300*time.Millisecond))
	t.Logf("every key handled %v after the crash", d.Round(time.Millisecond))
}

// BenchmarkRecoveryAfterCrash measures how long the keys a killed consumer
// held stay blocked: the time from the kill until another consumer has run
// the effect of every one, with the claim lease and extension interval of
// the old defaults (30 s, renewed every 10 s) and of the current ones
// (DefaultLease, renewed every fifth of it), on Redis. The broker hands the messages over after a second (crashHandover);
// the rest is the claims running out, and the overlapping duplicate's wait
// (WithOverlapRetryDelay, the lease by default) before it looks again. Each
// run takes about as long as it measures:
//
//	go test -run XXX -bench RecoveryAfterCrash -benchtime 1x ./idempotency/
func BenchmarkRecoveryAfterCrash(b *testing.B) {
	for _, c := range []struct {
		name string
		opts []idempotency.Option
	}{
		{"lease=30s,extend=10s", []idempotency.Option{idempotency.WithLease(30 * time.Second), idempotency.WithExtendInterval(10 * time.Second)}},
		{"defaults", nil},
		// Where a deferral costs nothing (Kafka: the runtime counts the
		// attempts, and a deferral is none), looking again sooner than a
		// lease finds the key as soon as the claim has run out.
		{"defaults,overlap-retry=1s", []idempotency.Option{idempotency.WithOverlapRetryDelay(time.Second)}},
	} {
		b.Run(c.name, func(b *testing.B) {
			var total time.Duration
			for range b.N {
				total += recoverFromCrash(b, teststores.Redis(b), 16, c.opts...)
			}
			b.ReportMetric(total.Seconds()/float64(b.N), "s/recovery")
			b.ReportMetric(0, "ns/op")
		})
	}
}
