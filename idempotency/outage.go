package idempotency

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// outageLogEvery spaces the log lines of one outage of the store: every
// message that finds the store down fails its Claim, and a line for each
// would drown the log (the runtime already logs each unavailable attempt).
const outageLogEvery = 30 * time.Second

// outage reports claims that failed because of the store, not the message:
// one warning when the store stops answering, one every outageLogEvery while
// it stays down (with the failures since the last), and one line when a
// claim succeeds again.
type outage struct {
	logger *slog.Logger
	down   atomic.Bool // read on every successful claim, without the lock

	mu       sync.Mutex
	began    time.Time // the first failure of the outage
	logged   time.Time // the last line
	failures int       // since the last line
	total    int       // in the outage
}

// failed records a failed claim of key.
func (o *outage) failed(ctx context.Context, key string, err error) {
	now := time.Now()
	o.mu.Lock()
	o.failures++
	o.total++
	first := !o.down.Load()
	if first {
		o.down.Store(true)
		o.began = now
	} else if now.Sub(o.logged) < outageLogEvery {
		o.mu.Unlock()
		return
	}
	n, began := o.failures, o.began
	o.logged, o.failures = now, 0
	o.mu.Unlock()
	if first {
		o.logger.WarnContext(ctx, "idempotency: the store cannot claim keys; messages wait without using up attempts until it can",
			slog.String("key", key), slog.Any("error", err))
		return
	}
	o.logger.WarnContext(ctx, "idempotency: the store still cannot claim keys",
		slog.Int("failed_claims", n), slog.Duration("for", now.Sub(began)), slog.String("key", key), slog.Any("error", err))
}

// answered records a claim the store made or answered.
func (o *outage) answered(ctx context.Context) {
	if !o.down.Load() {
		return
	}
	o.mu.Lock()
	if !o.down.Load() {
		o.mu.Unlock()
		return
	}
	o.down.Store(false)
	total, began := o.total, o.began
	o.total, o.failures = 0, 0
	o.mu.Unlock()
	o.logger.InfoContext(ctx, "idempotency: the store claims keys again",
		slog.Int("failed_claims", total), slog.Duration("after", time.Since(began)))
}
