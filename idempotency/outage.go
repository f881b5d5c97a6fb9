package idempotency

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// outageLogEvery spaces the warnings about a store that cannot claim keys:
// while it is down every message fails its Claim, and a line for each would
// drown the log (the runtime already logs each unavailable attempt).
const outageLogEvery = 30 * time.Second

// outage reports claims that failed because of the store, not the message:
// a warning at the first failure, then at most one every outageLogEvery
// (with the failures since the last), and a line when a claim succeeds
// after a warning. A store that flaps therefore logs at most two lines per
// outageLogEvery, whatever the message rate.
type outage struct {
	logger *slog.Logger
	warned atomic.Bool // a warning is out and no recovery line yet; read on every successful claim

	mu       sync.Mutex
	began    time.Time // the warning that made warned true
	logged   time.Time // the last warning
	failures int       // since the last warning
	total    int       // since the last recovery line
}

// failed records a failed claim of key.
func (o *outage) failed(ctx context.Context, key string, err error) {
	now := time.Now()
	o.mu.Lock()
	o.failures++
	o.total++
	if !o.logged.IsZero() && now.Sub(o.logged) < outageLogEvery {
		o.mu.Unlock()
		return
	}
	n := o.failures
	o.failures, o.logged = 0, now
	if !o.warned.Load() {
		o.began = now
		o.warned.Store(true)
	}
	began := o.began
	o.mu.Unlock()
	o.logger.WarnContext(ctx, "idempotency: the store cannot claim keys; messages wait without using up attempts until it can",
		slog.Int("failed_claims", n), slog.Duration("for", now.Sub(began)), slog.String("key", key), slog.Any("error", err))
}

// answered records a claim the store made or answered.
func (o *outage) answered(ctx context.Context) {
	if !o.warned.Load() {
		return
	}
	o.mu.Lock()
	if !o.warned.Load() {
		o.mu.Unlock()
		return
	}
	o.warned.Store(false)
	total, began := o.total, o.began
	o.total = 0
	o.mu.Unlock()
	o.logger.InfoContext(ctx, "idempotency: the store claims keys again",
		slog.Int("failed_claims", total), slog.Duration("after", time.Since(began)))
}
