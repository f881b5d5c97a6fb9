package redisstream

import (
	"context"
	"crypto/rand"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/internal/testkit/testbroker"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// redisAddr is the shared Redis the tests use (CUSTODY_REDIS_ADDR, default
// 127.0.0.1:6379). Tests that stop or restart a server run their own (see
// server_test.go).
func redisAddr() string { return testbroker.Addr("CUSTODY_REDIS_ADDR", "127.0.0.1:6379") }

// newClient connects to addr, skipping (or failing, with
// CUSTODY_REQUIRE_BROKERS=1) when nothing answers, and closes the client
// when the test ends.
func newClient(t testing.TB, addr string) *redis.Client {
	t.Helper()
	testbroker.Dial(t, "Redis", addr)
	c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 64})
	t.Cleanup(func() { c.Close() })
	if err := c.Ping(context.Background()).Err(); err != nil {
		testbroker.Unavailable(t, "Redis at "+addr, err)
	}
	return c
}

// env is one test's stream, group and dead-letter stream on the shared
// Redis, under names no other test (or helper on the machine) uses, deleted
// when the test ends.
type env struct {
	t      testing.TB
	client *redis.Client
	stream string
	group  string
	dlq    string
}

func newEnv(t testing.TB) *env {
	t.Helper()
	return newEnvOn(t, newClient(t, redisAddr()))
}

func newEnvOn(t testing.TB, c *redis.Client) *env {
	t.Helper()
	base := "custody-test:" + strings.NewReplacer("/", ".", " ", "_").Replace(t.Name()) + ":" + rand.Text()[:8]
	e := &env{t: t, client: c, stream: base, group: "g", dlq: base + ":dlq"}
	t.Cleanup(func() {
		delays, _ := delaysKey(e.stream, e.group)
		c.Del(context.Background(), e.stream, e.dlq, delays)
	})
	return e
}

func (e *env) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	e.t.Cleanup(cancel)
	return ctx
}

// open opens a Source on the env's stream with a short block and the
// test's logger, creating the group from the start of the stream.
func (e *env) open(opts ...Option) *Source {
	e.t.Helper()
	base := []Option{WithCreateGroup("0"), WithBlock(50 * time.Millisecond), WithLogger(testlog.New(e.t))}
	s, err := New(e.ctx(), e.client, e.stream, e.group, append(base, opts...)...)
	if err != nil {
		e.t.Fatal(err)
	}
	return s
}

// publish appends entries with the given bodies and returns their ids.
func (e *env) publish(bodies ...string) []string {
	e.t.Helper()
	ids := make([]string, len(bodies))
	for i, b := range bodies {
		id, err := e.client.XAdd(e.ctx(), &redis.XAddArgs{Stream: e.stream, Values: []string{DefaultBodyField, b}}).Result()
		if err != nil {
			e.t.Fatal(err)
		}
		ids[i] = id
	}
	return ids
}

// pending returns the group's pending entries (all consumers).
func (e *env) pending() []redis.XPendingExt {
	e.t.Helper()
	p, err := e.client.XPendingExt(e.ctx(), &redis.XPendingExtArgs{Stream: e.stream, Group: e.group, Start: "-", End: "+", Count: 100000}).Result()
	if err != nil {
		e.t.Fatal(err)
	}
	return p
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }
