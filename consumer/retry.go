package consumer

import (
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
// first failure).
type Backoff interface {
	Delay(n int) time.Duration
}

// ExponentialBackoff multiplies the delay by Multiplier on each retry, from
// Initial up to Max, and spreads it by Jitter so that many consumers failing
// at once do not retry in lock-step: each delay d becomes a uniform draw from
// [d*(1-Jitter), d].
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
