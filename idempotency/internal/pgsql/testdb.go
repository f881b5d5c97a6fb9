package pgsql

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/custody-go/custody/internal/testkit/testbroker"
)

// URLEnv names the environment variable holding the test database's URL.
const URLEnv = "CUSTODY_POSTGRES_URL"

var tableSeq atomic.Uint64

// TestPool connects to the test database (CUSTODY_POSTGRES_URL, default
// postgres://postgres@127.0.0.1:5432/test), skipping the test when it is
// unreachable, and closes the pool when the test ends.
func TestPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	dsn := testbroker.Addr(URLEnv, "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatalf("%s: %v", URLEnv, err)
	}
	host := u.Host
	if _, _, err := net.SplitHostPort(host); err != nil {
		host = net.JoinHostPort(host, "5432")
	}
	testbroker.Dial(t, "PostgreSQL", host)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, dsn)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		testbroker.Unavailable(t, "PostgreSQL at "+host, err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestTable returns a table name unique to this run, and drops the table
// when the test ends.
func TestTable(t testing.TB, pool *pgxpool.Pool, prefix string) string {
	t.Helper()
	name := fmt.Sprintf("%s_%d_%d", prefix, time.Now().UnixNano()%1e12, tableSeq.Add(1))
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+name)
	})
	return name
}
