package consumer

import (
	"fmt"
	"time"

	"github.com/custody-go/custody/internal/backoff"
)

// Retry is the retry policy.
type Retry struct {
	// MaxAttempts is how many times a message is handled before it goes to
	// the dead-letter destination. Default 5. 1 means no retries.
	MaxAttempts int
	// Backoff gives the delay before each retry. Default:
	// ExponentialBackoff{Initial: 200ms, Max: 1m, Multiplier: 2, Jitter: 0.5}.
	Backoff Backoff
}

// Backoff computes the delay before retry number n (1 for the retry after the
// first failure). The runtime waits at least minBackoff (a millisecond)
// whatever Delay returns, so that no policy can make it retry in a hot loop.
type Backoff interface {
	Delay(n int) time.Duration
}

// minBackoff is the shortest wait before a retry or a deferral.
const minBackoff = time.Millisecond

// backoffDelay is b's delay before retry n, never below minBackoff.
func backoffDelay(b Backoff, n int) time.Duration {
	return max(b.Delay(n), minBackoff)
}

// checkBackoff rejects the built-in policies' settings that would retry
// without waiting or never grow; other implementations are floored at run
// time (see Backoff).
func checkBackoff(b Backoff) error {
	switch b := b.(type) {
	case ExponentialBackoff:
		return b.check()
	case *ExponentialBackoff:
		if b == nil {
			return fmt.Errorf("consumer: WithRetry: nil *ExponentialBackoff; leave Backoff nil for the default")
		}
		return b.check()
	case ConstantBackoff:
		return b.check()
	case *ConstantBackoff:
		if b == nil {
			return fmt.Errorf("consumer: WithRetry: nil *ConstantBackoff; leave Backoff nil for the default")
		}
		return b.check()
	}
	return nil
}

func (b ExponentialBackoff) check() error {
	// Written so that NaN fails every comparison.
	if !(b.Initial > 0 && b.Multiplier >= 1 && b.Jitter >= 0 && b.Jitter <= 1 && (b.Max == 0 || b.Max >= b.Initial)) {
		return fmt.Errorf("consumer: WithRetry: ExponentialBackoff needs Initial > 0, Multiplier >= 1, 0 <= Jitter <= 1 and Max >= Initial (or 0), got %+v", b)
	}
	return nil
}

func (b ConstantBackoff) check() error {
	if b <= 0 {
		return fmt.Errorf("consumer: WithRetry: ConstantBackoff(%v) must be positive: retries would not wait", time.Duration(b))
	}
	return nil
}

// ExponentialBackoff multiplies the delay by Multiplier on each retry, from
// Initial up to Max (no cap when Max is 0), and spreads it by Jitter so that
// many consumers failing at once do not retry in lock-step: each delay d
// becomes a uniform draw from [d*(1-Jitter), d].
type ExponentialBackoff struct {
	Initial    time.Duration
	Max        time.Duration
	Multiplier float64
	Jitter     float64
}

// Delay implements Backoff.
func (b ExponentialBackoff) Delay(n int) time.Duration {
	return backoff.Exponential(b).Delay(n)
}

// ConstantBackoff waits the same time before every retry.
type ConstantBackoff time.Duration

// Delay implements Backoff.
func (b ConstantBackoff) Delay(int) time.Duration { return time.Duration(b) }

func defaultBackoff() Backoff {
	return ExponentialBackoff{Initial: 200 * time.Millisecond, Max: time.Minute, Multiplier: 2, Jitter: 0.5}
}
