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
func (e Exponential) Delay(n int) time.Duration {
	if n < 1 {
		n = 1
	}
	d := float64(e.Initial) * math.Pow(e.Multiplier, float64(n-1))
	if max := float64(e.Max); e.Max > 0 && (d > max || math.IsInf(d, 0) || math.IsNaN(d)) {
		d = max
	}
	if e.Jitter > 0 {
		d -= d * e.Jitter * rand.Float64()
	}
	return time.Duration(d)
}
