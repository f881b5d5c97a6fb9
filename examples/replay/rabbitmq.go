package main

import (
	"context"
	"errors"
	"io"

	"github.com/custody-go/custody/adapters/rabbitmq"
)

// openRabbitMQ opens the RabbitMQ dead-letter queue named by -dlq, on the
// broker at -url.
func openRabbitMQ(ctx context.Context, cfg config, out io.Writer) (*destination, error) {
	if cfg.dlq == "" {
		return nil, errors.New("-dlq: give the dead-letter queue's name")
	}
	opts := []rabbitmq.Option{rabbitmq.WithURL(cfg.url)}
	if cfg.throughExchange {
		opts = append(opts, rabbitmq.WithReplayThroughExchange())
	}
	r, err := rabbitmq.NewReplay(ctx, cfg.dlq, opts...)
	if err != nil {
		return nil, err
	}
	return &destination{replayer: r, name: "RabbitMQ queue " + cfg.dlq, close: func() { r.Close() }}, nil
}
