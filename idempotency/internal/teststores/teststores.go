// Package teststores builds every idempotency store against the test
// servers, so one test can run against all of them.
package teststores

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/pgsql"
	"github.com/custody-go/custody/idempotency/pgstore"
	"github.com/custody-go/custody/idempotency/redisstore"
	"github.com/custody-go/custody/idempotency/storetest"
	"github.com/custody-go/custody/internal/testkit/testbroker"
)

// Store names a constructor.
type Store struct {
	Name string
	New  func(t testing.TB) idempotency.Store
}

// All returns the memory, Redis and PostgreSQL stores. The shared ones skip
// (or fail, in CI) the test when their server is unreachable.
func All() []Store {
	return []Store{{"memory", Memory}, {"redis", Redis}, {"postgres", Postgres}}
}

// Memory returns a fresh MemoryStore.
func Memory(t testing.TB) idempotency.Store {
	s, err := idempotency.NewMemoryStore(idempotency.MemoryMaxEntries(1 << 20))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// RedisClient connects to the test Redis (CUSTODY_REDIS_ADDR, default
// 127.0.0.1:6379).
func RedisClient(t testing.TB) *redis.Client {
	t.Helper()
	addr := testbroker.Addr("CUSTODY_REDIS_ADDR", "127.0.0.1:6379")
	testbroker.Dial(t, "Redis", addr)
	c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 64})
	t.Cleanup(func() { c.Close() })
	if err := c.Ping(context.Background()).Err(); err != nil {
		testbroker.Unavailable(t, "Redis at "+addr, err)
	}
	return c
}

// Redis returns a Store under a key prefix of its own, deleting its keys
// when the test ends.
func Redis(t testing.TB) idempotency.Store {
	t.Helper()
	c := RedisClient(t)
	prefix := "custody-test:" + storetest.Key(t) + ":"
	s, err := redisstore.New(context.Background(), c, redisstore.WithPrefix(prefix))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		var keys []string
		for iter.Next(ctx) {
			keys = append(keys, iter.Val())
		}
		if len(keys) > 0 {
			c.Del(ctx, keys...)
		}
	})
	return s
}

// Postgres returns a Store in a table of its own, dropped when the test
// ends.
func Postgres(t testing.TB) idempotency.Store {
	t.Helper()
	pool := pgsql.TestPool(t)
	return PostgresOn(t, pool, pgsql.TestTable(t, pool, "custody_idem_test"))
}

// PostgresOn creates table in db and returns a Store over it.
func PostgresOn(t testing.TB, db pgstore.DB, table string) *pgstore.Store {
	t.Helper()
	ctx := context.Background()
	if err := pgstore.CreateSchema(ctx, db, pgstore.WithTable(table)); err != nil {
		t.Fatal(err)
	}
	s, err := pgstore.New(ctx, db, pgstore.WithTable(table))
	if err != nil {
		t.Fatal(err)
	}
	return s
}
