package redisstore_test

import (
	"context"
	"strings"
	"sync"
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

func TestBatchContract(t *testing.T) {
	storetest.RunBatch(t, func(t *testing.T) idempotency.BatchStore { return teststores.Redis(t).(idempotency.BatchStore) })
}

func TestRecordsExpireInRedis(t *testing.T) {
	// Redis forgets records by itself: no cleanup job is needed.
	ctx := context.Background()
	c := teststores.RedisClient(t)
	prefix := "custody-test:" + storetest.Key(t) + ":"
	s, err := redisstore.New(ctx, c, redisstore.WithPrefix(prefix))
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
	s, err := redisstore.New(ctx, c, redisstore.WithPrefix(prefix))
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

// replayingClient sends every SET twice and returns the second reply, as
// go-redis does when the reply to a SET that Redis already ran is lost (a
// read timeout, a reset connection) and it retries the command.
type replayingClient struct{ *redis.Client }

func (c replayingClient) SetArgs(ctx context.Context, key string, value any, a redis.SetArgs) *redis.StatusCmd {
	c.Client.SetArgs(ctx, key, value, a)
	return c.Client.SetArgs(ctx, key, value, a)
}

// A Claim whose SET is retried finds the record its own first send wrote.
// That is this claim, not another delivery's: reporting it as in progress
// elsewhere would defer a first delivery for a whole lease and count it as
// an overlapping duplicate, and nothing could complete or release the key.
func TestRetriedClaimFindsItsOwnRecord(t *testing.T) {
	ctx := context.Background()
	c := teststores.RedisClient(t)
	prefix := "custody-test:" + storetest.Key(t) + ":"
	s, err := redisstore.New(ctx, replayingClient{c}, redisstore.WithPrefix(prefix))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Del(ctx, prefix+"k") })
	st, tok, err := s.Claim(ctx, "k", "fp", time.Hour)
	if err != nil || st != idempotency.Acquired || tok == "" {
		t.Fatalf("retried Claim of an absent key = (%v, %q, %v), want acquired with a token", st, tok, err)
	}
	if err := s.Complete(ctx, "k", tok, time.Hour); err != nil {
		t.Fatalf("Complete with the retried claim's token: %v", err)
	}
	if st, _, err := s.Claim(ctx, "k", "fp", time.Hour); err != nil || st != idempotency.Completed {
		t.Fatalf("Claim after completion = (%v, %v), want completed", st, err)
	}
}

// expiryHook records the expiry, in milliseconds, of every SET ... PX and
// of every script call (its last argument) sent to Redis.
type expiryHook struct {
	mu  sync.Mutex
	got []int64
}

func (h *expiryHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *expiryHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *expiryHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		args := cmd.Args()
		for i, a := range args {
			if s, ok := a.(string); ok && strings.EqualFold(s, "px") && i+1 < len(args) {
				h.add(args[i+1])
			}
		}
		if name := strings.ToLower(cmd.Name()); name == "evalsha" || name == "eval" {
			h.add(args[len(args)-1])
		}
		return next(ctx, cmd)
	}
}

func (h *expiryHook) add(v any) {
	if n, ok := v.(int64); ok {
		h.mu.Lock()
		h.got = append(h.got, n)
		h.mu.Unlock()
	}
}

// A lease that is not a whole number of milliseconds is rounded up for
// Redis, never down: the middleware counts on the claim being held at least
// the lease it asked for (it extends, and cancels the handler, by that
// reckoning), and a claim that runs out before that lets a duplicate in
// while the holder believes it still holds the key.
func TestLeasesAreNeverShortenedForRedis(t *testing.T) {
	ctx := context.Background()
	c := teststores.RedisClient(t)
	prefix := "custody-test:" + storetest.Key(t) + ":"
	s, err := redisstore.New(ctx, c, redisstore.WithPrefix(prefix))
	if err != nil {
		t.Fatal(err)
	}
	hook := &expiryHook{} // after New: its probe is no claim
	c.AddHook(hook)
	t.Cleanup(func() { c.Del(ctx, prefix+"k") })
	const lease = 10*time.Second + 999*time.Microsecond
	_, tok, err := s.Claim(ctx, "k", "", lease)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Extend(ctx, "k", tok, lease); err != nil {
		t.Fatal(err)
	}
	hook.mu.Lock()
	defer hook.mu.Unlock()
	if len(hook.got) != 2 {
		t.Fatalf("saw expiries %v, want the claim's and the extension's", hook.got)
	}
	for _, ms := range hook.got {
		if time.Duration(ms)*time.Millisecond < lease {
			t.Fatalf("Redis was told %dms for a lease of %v: the claim runs out before its holder thinks", ms, lease)
		}
	}
}

func TestInvalidOptions(t *testing.T) {
	ctx := context.Background()
	if _, err := redisstore.New(ctx, nil); err == nil {
		t.Fatal("New(nil) succeeded")
	}
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	if _, err := redisstore.New(ctx, c, redisstore.WithPrefix("")); err == nil || !strings.Contains(err.Error(), "WithPrefix") {
		t.Fatalf("WithPrefix(\"\") = %v, want an error naming the option", err)
	}
}

// New fails when Redis does not answer, saying so and what to check,
// rather than hand out a store on which every message would wait.
func TestNewChecksThatRedisAnswers(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1}) // nothing listens there
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := redisstore.New(ctx, c)
	if err == nil {
		t.Fatal("New with an unreachable Redis succeeded")
	}
	for _, want := range []string{"127.0.0.1:1", "does not answer", "check the address", "connection refused"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("New with an unreachable Redis = %q, want it to say %q", err, want)
		}
	}
}

// The probe New makes leaves nothing behind in Redis.
func TestNewLeavesNoKeys(t *testing.T) {
	ctx := context.Background()
	c := teststores.RedisClient(t)
	prefix := "custody-test:" + storetest.Key(t) + ":"
	if _, err := redisstore.New(ctx, c, redisstore.WithPrefix(prefix)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		keys, err := c.Keys(ctx, prefix+"*").Result()
		if err != nil {
			t.Fatal(err)
		}
		if len(keys) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("New left %v in Redis", keys)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func BenchmarkClaimComplete(b *testing.B) {
	storetest.BenchmarkClaimComplete(b, teststores.Redis(b))
}

func BenchmarkClaimCompleteParallel(b *testing.B) {
	storetest.BenchmarkClaimCompleteParallel(b, teststores.Redis(b), 8)
}
