// Package backoff computes exponential delays with jitter.
package backoff

import (
	"math"
	"math/rand/v2"
	"time"
)

// Exponential grows from Initial by Multiplier per attempt up to Max, then
// spreads the result by Jitter: a delay d becomes a uniform draw from
// [d*(1-Jitter), d]. Jitter 0 gives exact delays; 1 gives "full jitter".
type Exponential struct {
	Initial    time.Duration
	Max        time.Duration
	Multiplier float64
	Jitter     float64
}

// Delay returns the delay before retry number n (n = 1 for the first retry).
// Without a Max, it stops growing at the largest time.Duration rather than
// overflowing into a negative one.
func (e Exponential) Delay(n int) time.Duration {
	if n < 1 {
		n = 1
	}
	limit := float64(math.MaxInt64)
	if e.Max > 0 {
		limit = float64(e.Max)
	}
	d := float64(e.Initial) * math.Pow(e.Multiplier, float64(n-1))
	if !(d < limit) { // also +Inf and NaN
		d = limit
	}
	if e.Jitter > 0 {
		d -= d * e.Jitter * rand.Float64()
	}
	if d >= float64(math.MaxInt64) {
		// float64(MaxInt64) rounds up to 2^63, which does not convert.
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(d)
}
