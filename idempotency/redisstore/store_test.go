package redisstore_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/teststores"
	"github.com/custody-go/custody/idempotency/redisstore"
	"github.com/custody-go/custody/idempotency/storetest"
)

func TestContract(t *testing.T) {
	storetest.Run(t, func(t *testing.T) idempotency.Store { return teststores.Redis(t) })
}

func TestRecordsExpireInRedis(t *testing.T) {
	// Redis forgets records by itself: no cleanup job is needed.
	ctx := context.Background()
	c := teststores.RedisClient(t)
	prefix := "custody-test:" + storetest.Key(t) + ":"
	s, err := redisstore.New(c, redisstore.WithPrefix(prefix))
	if err != nil {
		t.Fatal(err)
	}
	_, tok, err := s.Claim(ctx, "k", "", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if ttl := c.PTTL(ctx, prefix+"k").Val(); ttl <= 0 || ttl > time.Hour {
		t.Fatalf("claim's Redis TTL %v, want the lease", ttl)
	}
	if err := s.Complete(ctx, "k", tok, time.Minute); err != nil {
		t.Fatal(err)
	}
	if ttl := c.PTTL(ctx, prefix+"k").Val(); ttl <= 0 || ttl > time.Minute {
		t.Fatalf("completed record's Redis TTL %v, want the retention", ttl)
	}
	c.Del(ctx, prefix+"k")
}

func TestForeignValueIsReportedNotOverwritten(t *testing.T) {
	ctx := context.Background()
	c := teststores.RedisClient(t)
	prefix := "custody-test:" + storetest.Key(t) + ":"
	s, err := redisstore.New(c, redisstore.WithPrefix(prefix))
	if err != nil {
		t.Fatal(err)
	}
	c.Set(ctx, prefix+"k", "someone else's data", 0)
	t.Cleanup(func() { c.Del(ctx, prefix+"k") })
	if _, _, err := s.Claim(ctx, "k", "", time.Hour); err == nil || !strings.Contains(err.Error(), "not an idempotency record") {
		t.Fatalf("Claim over a key holding foreign data = %v, want an error saying so", err)
	}
	if v, _ := c.Get(ctx, prefix+"k").Result(); v != "someone else's data" {
		t.Fatalf("foreign value changed to %q", v)
	}
}

func TestInvalidOptions(t *testing.T) {
	if _, err := redisstore.New(nil); err == nil {
		t.Fatal("New(nil) succeeded")
	}
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	if _, err := redisstore.New(c, redisstore.WithPrefix("")); err == nil || !strings.Contains(err.Error(), "WithPrefix") {
		t.Fatalf("WithPrefix(\"\") = %v, want an error naming the option", err)
	}
}

func BenchmarkClaimComplete(b *testing.B) {
	storetest.BenchmarkClaimComplete(b, teststores.Redis(b))
}

func BenchmarkClaimCompleteParallel(b *testing.B) {
	storetest.BenchmarkClaimCompleteParallel(b, teststores.Redis(b), 8)
}
