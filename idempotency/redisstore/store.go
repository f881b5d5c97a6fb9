package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/internal/option"
)

// Client is what the store needs from go-redis: *redis.Client,
// *redis.ClusterClient and redis.UniversalClient all satisfy it. A client
// that also has go-redis's Pipeline method (all three have) takes the keys
// of a batch in one round trip (see idempotency.BatchStore); another one
// key at a time.
type Client interface {
	redis.Scripter
	SetArgs(ctx context.Context, key string, value any, a redis.SetArgs) *redis.StatusCmd
	Ping(ctx context.Context) *redis.StatusCmd
}

// Store is an idempotency.Store in Redis. It is safe for concurrent use.
type Store struct {
	c      Client
	prefix string
}

var _ idempotency.Store = (*Store)(nil)

// Option configures a Store.
type Option func(*Store) error

// WithPrefix sets the prefix of every Redis key the store writes, to keep
// its records apart from other data and from other applications' stores.
// Default "custody:idempotency:".
func WithPrefix(p string) Option {
	return func(s *Store) error {
		if p == "" {
			return errors.New("redisstore: WithPrefix(\"\"): an empty prefix would mix idempotency records with other keys")
		}
		s.prefix = p
		return nil
	}
}

// New returns a Store that keeps its records in c. It checks that Redis
// answers (PING) and accepts the claim command (SET with both NX and GET,
// Redis 7.0 or later), so that a wrong address, a missing password or an
// old server fails here, saying what to do, rather than leave every message
// waiting on a store that cannot serve it. ctx bounds those two round trips.
func New(ctx context.Context, c Client, opts ...Option) (*Store, error) {
	if c == nil {
		return nil, errors.New("redisstore: New(nil): pass a go-redis client")
	}
	s := &Store{c: c, prefix: "custody:idempotency:"}
	if err := option.Apply(s, opts); err != nil {
		return nil, err
	}
	if err := s.check(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

// check sends PING, and a claim on a probe key of the store's own, which
// expires at once.
func (s *Store) check(ctx context.Context) error {
	if err := s.c.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redisstore: New: Redis%s does not answer PING; check the address, the credentials and that the server runs: %w", where(s.c), err)
	}
	probe := s.prefix + "custody-probe:" + string(idempotency.NewToken())
	err := s.c.SetArgs(ctx, probe, "", redis.SetArgs{Mode: "NX", TTL: time.Millisecond, Get: true}).Err()
	if err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("redisstore: New: Redis%s refused the claim command SET NX GET, which needs Redis 7.0 or later: %w", where(s.c), err)
	}
	return nil
}

// where names the server c talks to, when c says.
func where(c Client) string {
	if o, ok := c.(interface{ Options() *redis.Options }); ok && o.Options() != nil {
		return " at " + o.Options().Addr
	}
	return ""
}

// Record values are "<state>:<token>:<fingerprint>" with state 'p' (in
// progress) or 'c' (completed). Tokens never contain ':'.
const (
	inProgress = "p:"
	completed  = "c:"
)

// Claim implements idempotency.Store.
func (s *Store) Claim(ctx context.Context, key, fingerprint string, lease time.Duration) (idempotency.State, idempotency.Token, error) {
	if err := checkDuration("lease", lease); err != nil {
		return 0, "", err
	}
	tok := idempotency.NewToken()
	old, err := s.c.SetArgs(ctx, s.prefix+key, inProgress+string(tok)+":"+fingerprint, claimArgs(lease)).Result()
	return s.claimed(key, fingerprint, tok, old, err)
}

// claimArgs makes the SET create the record only where there is none, and
// return the one there is.
func claimArgs(lease time.Duration) redis.SetArgs {
	return redis.SetArgs{Mode: "NX", TTL: time.Duration(millis(lease)) * time.Millisecond, Get: true}
}

// claimed reads the reply to the claim of key with tok.
func (s *Store) claimed(key, fingerprint string, tok idempotency.Token, old string, err error) (idempotency.State, idempotency.Token, error) {
	if errors.Is(err, redis.Nil) {
		return idempotency.Acquired, tok, nil
	}
	if err != nil {
		return 0, "", fmt.Errorf("redisstore: claim %q: %w", key, err)
	}
	if strings.HasPrefix(old, inProgress+string(tok)+":") {
		// Our own record: go-redis retried the SET after losing the reply
		// to a first send that Redis had run. The token is fresh, so no
		// other claim can hold it.
		return idempotency.Acquired, tok, nil
	}
	state, oldFP, ok := parse(old)
	if !ok {
		return 0, "", fmt.Errorf("redisstore: claim %q: key %q holds %q, which is not an idempotency record; is the prefix shared with other data?", key, s.prefix+key, old)
	}
	if fingerprint != "" && oldFP != "" && fingerprint != oldFP {
		return 0, "", fmt.Errorf("%w (key %q)", idempotency.ErrFingerprintMismatch, key)
	}
	return state, "", nil
}

func parse(v string) (idempotency.State, string, bool) {
	var state idempotency.State
	switch {
	case strings.HasPrefix(v, inProgress):
		state = idempotency.InProgressElsewhere
	case strings.HasPrefix(v, completed):
		state = idempotency.Completed
	default:
		return 0, "", false
	}
	_, fp, ok := strings.Cut(v[2:], ":")
	return state, fp, ok
}

// The scripts return 1 when the token matched and the change was made, 0
// when it did not (the token is stale).
var (
	completeScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local held = 'p:' .. ARGV[1] .. ':'
if string.sub(v, 1, #held) == held then
  redis.call('SET', KEYS[1], 'c:' .. string.sub(v, 3), 'PX', ARGV[2])
  return 1
end
local done = 'c:' .. ARGV[1] .. ':'
if string.sub(v, 1, #done) == done then return 1 end
return 0
`)
	releaseScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
local held = 'p:' .. ARGV[1] .. ':'
if v and string.sub(v, 1, #held) == held then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
`)
	extendScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
local held = 'p:' .. ARGV[1] .. ':'
if v and string.sub(v, 1, #held) == held then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
`)
)

// Complete implements idempotency.Store.
func (s *Store) Complete(ctx context.Context, key string, token idempotency.Token, retention time.Duration) error {
	if err := checkDuration("retention", retention); err != nil {
		return err
	}
	return s.run(ctx, "complete", completeScript, key, string(token), millis(retention))
}

// Release implements idempotency.Store.
func (s *Store) Release(ctx context.Context, key string, token idempotency.Token) error {
	return s.run(ctx, "release", releaseScript, key, string(token))
}

// Extend implements idempotency.Store.
func (s *Store) Extend(ctx context.Context, key string, token idempotency.Token, lease time.Duration) error {
	if err := checkDuration("lease", lease); err != nil {
		return err
	}
	return s.run(ctx, "extend", extendScript, key, string(token), millis(lease))
}

func (s *Store) run(ctx context.Context, op string, script *redis.Script, key string, args ...any) error {
	n, err := script.Run(ctx, s.c, []string{s.prefix + key}, args...).Int()
	return result(op, key, n, err)
}

// result reads a script's reply n (or its error) for key.
func result(op, key string, n int, err error) error {
	if err != nil {
		return fmt.Errorf("redisstore: %s %q: %w", op, key, err)
	}
	if n != 1 {
		return fmt.Errorf("%w (key %q)", idempotency.ErrStaleToken, key)
	}
	return nil
}

// millis rounds d up to whole milliseconds, Redis's precision: a claim
// must be held at least as long as its holder was told (the middleware
// extends it, and cancels the handler, by that reckoning), never a fraction
// of a millisecond less.
func millis(d time.Duration) int64 {
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}

func checkDuration(name string, d time.Duration) error {
	if d < time.Millisecond {
		return fmt.Errorf("redisstore: %s %v: must be at least 1ms (Redis expiries have millisecond precision)", name, d)
	}
	return nil
}
