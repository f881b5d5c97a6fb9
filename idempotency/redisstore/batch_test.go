package redisstore_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/teststores"
	"github.com/custody-go/custody/idempotency/redisstore"
	"github.com/custody-go/custody/idempotency/storetest"
)

// unknownScripts makes the EVALSHA of the first pipeline name a script
// Redis does not hold, as after a restart or a SCRIPT FLUSH, without
// flushing the cache that other tests share.
type unknownScripts struct{ pipelines atomic.Int32 }

func (*unknownScripts) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (*unknownScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (h *unknownScripts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.pipelines.Add(1) == 1 {
			for _, c := range cmds {
				if strings.EqualFold(c.Name(), "evalsha") {
					c.Args()[1] = strings.Repeat("0", 40)
				}
			}
		}
		return next(ctx, cmds)
	}
}

// A pipeline whose scripts Redis no longer holds answers NOSCRIPT for
// each; they did not run, so the store loads the script and sends them
// again, and the batch succeeds.
func TestBatchLoadsAScriptRedisLost(t *testing.T) {
	teststores.RedisClient(t) // skips the test when Redis is unreachable
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: teststores.RedisClient(t).Options().Addr})
	t.Cleanup(func() { c.Close() })
	hook := &unknownScripts{}
	prefix := "custody-test:" + storetest.Key(t) + ":"
	s, err := redisstore.New(ctx, c, redisstore.WithPrefix(prefix))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Del(ctx, prefix+"a", prefix+"b") })
	res := s.ClaimBatch(ctx, []idempotency.ClaimRequest{{Key: "a"}, {Key: "b"}}, time.Hour)
	held := make([]idempotency.HeldClaim, len(res))
	for i, r := range res {
		if r.Err != nil || r.State != idempotency.Acquired {
			t.Fatalf("ClaimBatch entry %d = %+v", i, r)
		}
		held[i] = idempotency.HeldClaim{Key: []string{"a", "b"}[i], Token: r.Token}
	}
	c.AddHook(hook)
	for i, err := range s.CompleteBatch(ctx, held, time.Hour) {
		if err != nil {
			t.Fatalf("CompleteBatch entry %d after Redis lost the script: %v", i, err)
		}
	}
	if hook.pipelines.Load() < 2 {
		t.Fatal("the hook never saw the scripts sent again")
	}
	for _, k := range []string{"a", "b"} {
		if st, _, err := s.Claim(ctx, k, "", time.Hour); err != nil || st != idempotency.Completed {
			t.Fatalf("Claim(%q) after CompleteBatch = %v, %v; want completed", k, st, err)
		}
	}
}
