// Package pace spaces operations out to a bounded rate, for tools that
// move messages (dead-letter replay) and must not flood a queue or a
// consumer behind it.
package pace

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Pacer lets operations start at most Rate a second, evenly spaced: the
// first at once, each later one an interval after the one before (or at
// once, if it comes later than that). It is not safe for concurrent use:
// one loop owns it.
type Pacer struct {
	interval time.Duration
	next     time.Time
}

// New returns a Pacer for perSecond operations a second; perSecond must be
// positive.
func New(perSecond float64) *Pacer {
	iv := time.Duration(float64(time.Second) / perSecond)
	return &Pacer{interval: max(iv, 0)}
}

// DefaultReplayRate is the rate of a dead-letter replay whose
// adapters.ReplayOptions.Rate is zero, as package adapters documents it.
const DefaultReplayRate = 10

// ForReplay returns the Pacer of a dead-letter replay asked for rate
// messages a second (zero means DefaultReplayRate) and at most max messages
// (zero means no bound): the fields of adapters.ReplayOptions. It fails,
// naming the field, when either is negative or rate is NaN.
func ForReplay(rate float64, max int) (*Pacer, error) {
	switch {
	case !(rate >= 0): // negative, or NaN
		return nil, fmt.Errorf("ReplayOptions.Rate %v must not be negative (zero means %d a second)", rate, DefaultReplayRate)
	case max < 0:
		return nil, errors.New("ReplayOptions.Max must not be negative (zero means no bound)")
	case rate == 0:
		rate = DefaultReplayRate
	}
	return New(rate), nil
}

// Interval is the spacing between two operations.
func (p *Pacer) Interval() time.Duration { return p.interval }

// Ready waits until an operation may start, without starting one. It
// returns ctx's error if ctx has ended or ends first.
func (p *Pacer) Ready(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	d := time.Until(p.next)
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Wait waits until an operation may start and counts it as started. It
// returns ctx's error, and counts nothing, if ctx has ended or ends first.
func (p *Pacer) Wait(ctx context.Context) error {
	if err := p.Ready(ctx); err != nil {
		return err
	}
	p.next = time.Now().Add(p.interval)
	return nil
}
