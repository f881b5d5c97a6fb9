package redisstore_test

import (
	"context"
	"log"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/redisstore"
)

// The idempotency middleware with its records in Redis, shared by every
// consumer that connects to it. New checks that Redis answers.
func Example() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer rdb.Close()
	store, err := redisstore.New(ctx, rdb)
	if err != nil {
		log.Fatal(err) // Redis does not answer, or is older than 7.0
	}
	dedup, err := idempotency.New(store)
	if err != nil {
		log.Fatal(err)
	}
	var handler consumer.Handler // performs the effect
	_ = consumer.Chain(handler, dedup)
}
