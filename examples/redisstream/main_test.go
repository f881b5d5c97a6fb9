package main

import (
	"context"
	"crypto/rand"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/internal/testkit/testbroker"
)

func TestExampleRuns(t *testing.T) {
	addr := testbroker.Addr("CUSTODY_REDIS_ADDR", "127.0.0.1:6379")
	testbroker.Dial(t, "Redis", addr)
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out strings.Builder
	cfg := config{addr: addr, stream: "custody-example-test-orders:" + rand.Text()[:8], orders: 120}
	if err := run(ctx, rdb, cfg, &out); err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + out.String())
	if !strings.Contains(out.String(), "dead-lettered") {
		t.Errorf("no dead-lettered order reported:\n%s", out.String())
	}
}
