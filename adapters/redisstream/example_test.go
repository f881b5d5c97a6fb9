package redisstream_test

import (
	"context"
	"log"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/adapters/redisstream"
	"github.com/custody-go/custody/consumer"
)

// A consumer of one stream through the group "billing", created (with the
// stream) when missing, with a dead-letter stream beside it.
func Example() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer rdb.Close()

	src, err := redisstream.New(ctx, rdb, "orders", "billing", redisstream.WithCreateGroup("$"))
	if err != nil {
		log.Fatal(err)
	}
	dlq, err := redisstream.NewDeadLetter(ctx, rdb, "orders-dlq")
	if err != nil {
		log.Fatal(err)
	}
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		// m.Body is the entry's "body" field, m.Headers its other fields,
		// m.Attempt the group's delivery count.
		var entry redis.XMessage
		if m.As(&entry) {
			_ = entry.Values // the entry as go-redis read it
		}
		return nil
	}),
		consumer.WithConcurrency(32),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 5}),
		consumer.WithDeadLetter(dlq))
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Run(ctx); err != nil {
		log.Fatal(err)
	}
}

// On a Redis Cluster, the stream and its dead-letter stream share a hash tag
// so that a dead letter is appended and its original acknowledged in one
// atomic step on one node.
func ExampleNewDeadLetter_cluster() {
	ctx := context.Background()
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"redis-1:6379", "redis-2:6379"}})
	src, err := redisstream.New(ctx, rdb, "{orders}", "billing")
	if err != nil {
		log.Fatal(err)
	}
	dlq, err := redisstream.NewDeadLetter(ctx, rdb, "{orders}:dlq")
	if err != nil {
		log.Fatal(err)
	}
	_, _ = src, dlq
}
