package idempotency_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/pgsql"
	"github.com/custody-go/custody/idempotency/internal/teststores"
	"github.com/custody-go/custody/idempotency/redisstore"
	"github.com/custody-go/custody/idempotency/storetest"
)

// A store that cannot be reached is an outage around the handler, not a
// failure of the messages: with the store's connections cut, a stream of
// valid messages far outlasts MaxAttempts, and yet none is dead-lettered,
// none is redelivered (the broker's receive count, Message.Attempt, stays
// at 1), and every effect runs once the store is back. Before, every
// message reached the dead-letter queue within seconds, attempts used up by
// "connection refused".
func TestStoreOutageDeadLettersNothing(t *testing.T) {
	for _, st := range linkedStores() {
		t.Run(st.name, func(t *testing.T) {
			const (
				n           = 20
				maxAttempts = 3
			)
			store, link := st.new(t)
			link.Cut()

			b := memory.NewBroker()
			if err := b.CreateQueue("q", memory.QueueOptions{Lease: time.Second}); err != nil {
				t.Fatal(err)
			}
			if err := b.CreateQueue("dlq", memory.QueueOptions{}); err != nil {
				t.Fatal(err)
			}
			for i := range n {
				if err := b.Publish(context.Background(), "q", memory.Message{ID: fmt.Sprintf("order-%d", i), Body: []byte("x")}); err != nil {
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
			h := newGuard(t, store, func(_ context.Context, msg *consumer.Message) error {
				mu.Lock()
				defer mu.Unlock()
				runs[msg.ID]++
				attempts = append(attempts, msg.Attempt)
				return nil
			}, idempotency.WithMeterProvider(m), idempotency.WithLogger(quiet))
			src, err := b.Source("q", memory.WithPollWait(20*time.Millisecond))
			if err != nil {
				t.Fatal(err)
			}
			c, err := consumer.New(src, h, consumer.WithLogger(quiet), consumer.WithConcurrency(4), consumer.WithDeadLetter(dlq),
				consumer.WithRetry(consumer.Retry{MaxAttempts: maxAttempts, Backoff: consumer.ConstantBackoff(5 * time.Millisecond)}))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- c.Run(ctx) }()
			defer func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("Run: %v", err)
				}
			}()

			// Twice as many failed claims as n messages have attempts: at
			// least one message failed twice its MaxAttempts over.
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
			wctx, wcancel := context.WithTimeout(context.Background(), time.Minute)
			defer wcancel()
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
			s, err := b.Stats("q")
			if err != nil {
				t.Fatal(err)
			}
			if s.Received != n || s.Acked != n {
				t.Fatalf("queue: %d receives and %d acks for %d messages, want each received once and acked", s.Received, s.Acked, n)
			}
		})
	}
}

// linkedStore is a shared store whose connections a test can cut.
type linkedStore struct {
	name string
	new  func(t *testing.T) (idempotency.Store, *teststores.Link)
}

// linkedStores returns the Redis and PostgreSQL stores, each reached
// through a Link.
func linkedStores() []linkedStore {
	return []linkedStore{
		{"redis", func(t *testing.T) (idempotency.Store, *teststores.Link) {
			c, link := teststores.RedisVia(t)
			prefix := "custody-test:" + storetest.Key(t) + ":"
			s, err := redisstore.New(context.Background(), c, redisstore.WithPrefix(prefix))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				direct := teststores.RedisClient(t)
				keys, _ := direct.Keys(context.Background(), prefix+"*").Result()
				if len(keys) > 0 {
					direct.Del(context.Background(), keys...)
				}
			})
			return s, link
		}},
		{"postgres", func(t *testing.T) (idempotency.Store, *teststores.Link) {
			pool, link := teststores.PostgresVia(t)
			table := pgsql.TestTable(t, pgsql.TestPool(t), "custody_idem_test")
			return teststores.PostgresOn(t, pool, table), link
		}},
	}
}

// downStore fails every call while down is set.
type downStore struct {
	idempotency.Store
	down atomic.Bool
}

var errDown = errors.New("dial tcp 127.0.0.1:6379: connect: connection refused")

func (s *downStore) Claim(ctx context.Context, key, fp string, lease time.Duration) (idempotency.State, idempotency.Token, error) {
	if s.down.Load() {
		return 0, "", errDown
	}
	return s.Store.Claim(ctx, key, fp, lease)
}

// syncBuffer is a bytes.Buffer for a logger and a test to share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) lines() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Split(strings.TrimSpace(b.b.String()), "\n")
}

// An outage of the store is logged when it begins and when it ends, not
// once per message: while the store is down every message fails its claim,
// and the runtime logs each of those attempts already.
func TestStoreOutageIsLoggedWithoutALinePerMessage(t *testing.T) {
	var log syncBuffer
	store := &downStore{Store: newMemory(t)}
	store.down.Store(true)
	m := newMeter(t)
	h := newGuard(t, store, func(context.Context, *consumer.Message) error { return nil },
		idempotency.WithMeterProvider(m), idempotency.WithLogger(slog.New(slog.NewTextHandler(&log, nil))))
	const n = 50
	for i := range n {
		if err := h.Handle(context.Background(), msg(fmt.Sprint("m-", i), "x")); !consumer.IsUnavailable(err) || !errors.Is(err, errDown) {
			t.Fatalf("Handle with the store down = %v, want an unavailable error wrapping the store's", err)
		}
	}
	if got := m.count(t, idempotency.MetricStoreErrors, "custody.idempotency.op", "claim"); got != n {
		t.Fatalf("store errors (claim) = %d, want %d: each failed claim is counted", got, n)
	}
	lines := log.lines()
	if len(lines) != 1 || !strings.Contains(lines[0], "level=WARN") || !strings.Contains(lines[0], "connection refused") {
		t.Fatalf("log after %d failed claims:\n%s\nwant one warning with the store's error", n, strings.Join(lines, "\n"))
	}
	store.down.Store(false)
	for range 3 {
		if err := h.Handle(context.Background(), msg("m-0", "x")); err != nil {
			t.Fatal(err)
		}
	}
	lines = log.lines()
	if len(lines) != 2 || !strings.Contains(lines[1], "level=INFO") || !strings.Contains(lines[1], fmt.Sprint("failed_claims=", n)) {
		t.Fatalf("log once the store answers again:\n%s\nwant one more line, saying it recovered after %d failed claims", strings.Join(lines, "\n"), n)
	}
	// A store that flaps, failing every other claim, adds no line until
	// the next report is due.
	for i := range n {
		store.down.Store(i%2 == 0)
		_ = h.Handle(context.Background(), msg(fmt.Sprint("f-", i), "x"))
	}
	if lines := log.lines(); len(lines) != 2 {
		t.Fatalf("log after a flapping store:\n%s\nwant no more lines within %v of the last warning", strings.Join(lines, "\n"), 30*time.Second)
	}
}
