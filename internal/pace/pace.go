// Package pace spaces operations out to a bounded rate, for tools that
// move messages (dead-letter replay) and must not flood a queue or a
// consumer behind it.
package pace

import (
	"context"
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
