package teststores

import (
	"context"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/idempotency/internal/pgsql"
	"github.com/custody-go/custody/internal/testkit/testbroker"
)

// refusedAddr is where nothing listens: a dial there is refused by the
// kernel, as a dial to a stopped server is (port 1 is privileged, so no
// test can take it).
const refusedAddr = "127.0.0.1:1"

// Link is the way from a client to a test server, for a test to cut and
// restore: while it is down, dials are refused (they go to a port where
// nothing listens) or, when silent, connect to a listener that never says a
// word; the connections made while it was up are closed when it goes down.
// Clients reach it through Dial, so what they see are real network errors.
type Link struct {
	addr string

	mu     sync.Mutex
	state  linkState
	conns  map[net.Conn]struct{}
	silent net.Listener // made on the first Silence
	held   []net.Conn   // accepted by silent, never answered
}

type linkState int

const (
	linkUp linkState = iota
	linkRefused
	linkSilent
)

// NewLink returns a Link to addr, up, and closes what it holds when the
// test ends.
func NewLink(t testing.TB, addr string) *Link {
	l := &Link{addr: addr, conns: make(map[net.Conn]struct{})}
	t.Cleanup(l.close)
	return l
}

// Dial connects to the server while the link is up; it has the signature
// of go-redis's Options.Dialer and pgconn's DialFunc.
func (l *Link) Dial(ctx context.Context, network, _ string) (net.Conn, error) {
	l.mu.Lock()
	addr := l.addr
	switch l.state {
	case linkRefused:
		addr = refusedAddr
	case linkSilent:
		addr = l.silent.Addr().String()
	}
	l.mu.Unlock()
	var d net.Dialer
	c, err := d.DialContext(ctx, network, addr)
	if err != nil || addr != l.addr {
		return c, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.state != linkUp { // cut while dialing
		_ = c.Close()
		return d.DialContext(ctx, network, refusedAddr)
	}
	l.conns[c] = struct{}{}
	return c, nil
}

// Cut closes the connections made so far and refuses new ones.
func (l *Link) Cut() { l.down(linkRefused) }

// Silence closes the connections made so far and sends new ones to a
// server that accepts them and never answers, as a hung server or a
// network that drops packets does.
func (l *Link) Silence() { l.down(linkSilent) }

// Restore lets dials through again.
func (l *Link) Restore() {
	l.mu.Lock()
	l.state = linkUp
	l.mu.Unlock()
}

func (l *Link) down(s linkState) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if s == linkSilent && l.silent == nil {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			panic(err) // the loopback interface always has a free port
		}
		l.silent = ln
		go l.hold(ln)
	}
	l.state = s
	for c := range l.conns {
		_ = c.Close()
	}
	clear(l.conns)
}

func (l *Link) hold(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		l.mu.Lock()
		l.held = append(l.held, c)
		l.mu.Unlock()
	}
}

func (l *Link) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.silent != nil {
		_ = l.silent.Close()
	}
	for _, c := range l.held {
		_ = c.Close()
	}
	for c := range l.conns {
		_ = c.Close()
	}
}

// RedisVia returns a client of the test Redis that connects through a
// Link of its own, and the Link.
func RedisVia(t testing.TB) (*redis.Client, *Link) {
	t.Helper()
	RedisClient(t) // skips the test when Redis is unreachable
	addr := testbroker.Addr("CUSTODY_REDIS_ADDR", "127.0.0.1:6379")
	l := NewLink(t, addr)
	c := redis.NewClient(&redis.Options{Addr: addr, Dialer: l.Dial})
	t.Cleanup(func() { c.Close() })
	return c, l
}

// PostgresVia returns a pool on the test database that connects through a
// Link of its own, and the Link.
func PostgresVia(t testing.TB) (*pgxpool.Pool, *Link) {
	t.Helper()
	direct := pgsql.TestPool(t) // skips the test when PostgreSQL is unreachable
	cfg := direct.Config()
	if strings.HasPrefix(cfg.ConnConfig.Host, "/") {
		t.Skipf("%s names a Unix socket; this test cuts a TCP connection", pgsql.URLEnv)
	}
	l := NewLink(t, net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))))
	cfg.ConnConfig.DialFunc = l.Dial
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, l
}
