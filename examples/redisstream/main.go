// Command redisstream runs custody on a Redis stream through a consumer
// group: a few hundred orders handled at concurrency 16, a flaky dependency
// retried with backoff (the retry waits in the group's pending list, as an
// idle time, not in the process), a malformed order moved to a dead-letter
// stream with its diagnostics (appended and acknowledged in one atomic
// step), and a slow order whose lease is renewed while it works.
//
// It needs Redis 7.0 or later; by default the local one:
//
//	go run ./examples/redisstream -addr 127.0.0.1:6379
//
// It writes the stream custody-example-orders and its dead-letter stream
// custody-example-orders-dlq, and deletes them when it is done unless -keep
// is given.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/redisstream"
	"github.com/custody-go/custody/consumer"
)

type order struct {
	ID     int `json:"id"`
	Amount int `json:"amount"`
}

type config struct {
	addr   string
	stream string
	orders int
	keep   bool
}

const (
	maxAttempts = 4
	poisonID    = 13 // malformed: dead-lettered at once
	flakyMod    = 25 // orders whose id is a multiple of this fail twice first
	slowID      = 42 // takes three leases
	lease       = time.Second
)

func main() {
	var cfg config
	flag.StringVar(&cfg.addr, "addr", "127.0.0.1:6379", "address of the Redis server")
	flag.StringVar(&cfg.stream, "stream", "custody-example-orders", "stream to write and consume (its dead-letter stream is NAME-dlq)")
	flag.IntVar(&cfg.orders, "orders", 300, "how many orders to publish")
	flag.BoolVar(&cfg.keep, "keep", false, "keep the streams afterwards")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rdb := redis.NewClient(&redis.Options{Addr: cfg.addr})
	defer rdb.Close()
	if err := run(ctx, rdb, cfg, os.Stdout); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, rdb *redis.Client, cfg config, out io.Writer) error {
	dlqName := cfg.stream + "-dlq"
	if !cfg.keep {
		defer rdb.Del(context.Background(), cfg.stream, dlqName, "{"+cfg.stream+"}:custody-delays:example")
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	// The group reads the stream from its first entry; New creates both
	// when they do not exist.
	src, err := redisstream.New(ctx, rdb, cfg.stream, "example",
		redisstream.WithCreateGroup("0"),
		redisstream.WithLease(lease),
		redisstream.WithLogger(logger))
	if err != nil {
		return err
	}
	dlq, err := redisstream.NewDeadLetter(ctx, rdb, dlqName)
	if err != nil {
		src.Close()
		return err
	}

	var (
		handled  atomic.Int64
		mu       sync.Mutex
		attempts = map[int]int{}
		done     = make(chan struct{})
		once     sync.Once
	)
	want := int64(cfg.orders - 1) // all but the poison order
	handler := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		var o order
		if err := json.Unmarshal(m.Body, &o); err != nil {
			return consumer.Permanent(fmt.Errorf("order is not valid JSON: %w", err))
		}
		mu.Lock()
		attempts[o.ID] = m.Attempt // the group's delivery count
		mu.Unlock()
		if o.ID%flakyMod == 0 && m.Attempt < 3 {
			// Given back with a delay: the retry waits in Redis.
			return consumer.RetryAfter(errors.New("payment service unavailable"), 300*time.Millisecond)
		}
		if o.ID == slowID {
			// Three leases: the runtime renews the lease meanwhile.
			select {
			case <-time.After(3 * lease):
			case <-ctx.Done():
				return context.Cause(ctx)
			}
		}
		if handled.Add(1) == want {
			once.Do(func() { close(done) })
		}
		return nil
	})
	c, err := consumer.New(src, handler,
		consumer.WithConcurrency(16),
		consumer.WithRetry(consumer.Retry{MaxAttempts: maxAttempts}),
		consumer.WithDeadLetter(dlq),
		consumer.WithLogger(logger))
	if err != nil {
		src.Close()
		return err
	}
	if err := publish(ctx, rdb, cfg.stream, cfg.orders); err != nil {
		src.Close()
		return err
	}

	runCtx, stop := context.WithCancel(ctx)
	ran := make(chan error, 1)
	start := time.Now()
	go func() { ran <- c.Run(runCtx) }()
	select {
	case <-done:
	case err := <-ran:
		stop()
		return fmt.Errorf("consumer stopped early: %w", err)
	case <-ctx.Done():
		stop()
		<-ran
		return fmt.Errorf("handled %d of %d orders before giving up: %w", handled.Load(), want, ctx.Err())
	}
	took := time.Since(start)
	stop()
	if err := <-ran; err != nil {
		return err
	}

	st := src.Stats()
	fmt.Fprintf(out, "handled %d orders in %v\n", handled.Load(), took.Round(time.Millisecond))
	mu.Lock()
	fmt.Fprintf(out, "order %d succeeded on delivery %d, after two retries that waited in Redis\n", flakyMod, attempts[flakyMod])
	fmt.Fprintf(out, "order %d ran for three leases on delivery %d: %d renewals kept it\n", slowID, attempts[slowID], st.Renewed)
	mu.Unlock()
	fmt.Fprintf(out, "commands: %d reads, %d reclaims, %d acks, %d renewals, %d give-backs: %.3f per message\n",
		st.Reads, st.Reclaims, st.Acks, st.Renewals, st.Nacks, float64(st.Commands())/float64(max(st.Received, 1)))
	dead, err := rdb.XRange(ctx, dlqName, "-", "+").Result()
	if err != nil {
		return err
	}
	for _, m := range dead {
		fmt.Fprintf(out, "dead-lettered %q: %s=%q %s=%v %s=%v\n", m.Values["body"],
			adapters.HeaderError, m.Values[adapters.HeaderError],
			adapters.HeaderAttempts, m.Values[adapters.HeaderAttempts],
			adapters.HeaderOriginalID, m.Values[adapters.HeaderOriginalID])
	}
	if len(dead) != 1 {
		return fmt.Errorf("expected one dead-lettered order, found %d", len(dead))
	}
	pending, err := rdb.XPending(ctx, cfg.stream, "example").Result()
	if err != nil {
		return err
	}
	if pending.Count != 0 {
		return fmt.Errorf("%d entries still pending", pending.Count)
	}
	return nil
}

// publish appends the orders, the body in the "body" field; order 13 is
// malformed.
func publish(ctx context.Context, rdb *redis.Client, stream string, n int) error {
	pipe := rdb.Pipeline()
	for id := 1; id <= n; id++ {
		body, _ := json.Marshal(order{ID: id, Amount: id * 100})
		if id == poisonID {
			body = []byte("{not json")
		}
		pipe.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []string{"body", string(body), "source", "example"}})
	}
	_, err := pipe.Exec(ctx)
	return err
}
