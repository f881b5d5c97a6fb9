package consumer

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/custody-go/custody/adapters"
)

// WithBacklogInterval sets how often the runtime asks a source that can
// tell its backlog (adapters.BacklogReporter: SQS queue attributes, a
// RabbitMQ queue's depth, a Kafka group's lag, a JetStream consumer's or a
// Redis group's pending counts, the memory broker's queue) for it, to
// report as the gauges custody.backlog.waiting, .in_flight and .oldest_age
// and in Status. Each poll is one request to the broker. Default 30s. Must
// be at least a second.
func WithBacklogInterval(d time.Duration) Option {
	return optionFunc(func(c *config) error {
		if d < time.Second {
			return fmt.Errorf("consumer: WithBacklogInterval(%v): must be at least a second", d)
		}
		c.backlogInterval = d
		return nil
	})
}

// backlogReading is a backlog as polled, and when.
type backlogReading struct {
	backlog adapters.Backlog
	at      time.Time
}

// pollBacklog asks br for the source's backlog at once, then every
// interval, until ctx ends.
func (r *run) pollBacklog(ctx context.Context, br adapters.BacklogReporter) {
	t := time.NewTicker(r.cfg.backlogInterval)
	defer t.Stop()
	for {
		pctx, cancel := context.WithTimeout(ctx, min(r.cfg.backlogInterval, 10*time.Second))
		b, err := br.Backlog(pctx)
		cancel()
		switch {
		case err == nil:
			r.backlog.Store(&backlogReading{backlog: b, at: time.Now()})
		case ctx.Err() == nil:
			r.logs.log(logBacklogFailed, slog.Any("error", err))
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
	}
}
