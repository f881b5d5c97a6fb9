package main

import (
	"context"
	"errors"
	"io"
	"strings"

	"github.com/custody-go/custody/adapters/kafka"
)

// openKafka opens the Kafka dead-letter topic named by -dlt, on the cluster
// at -brokers, with -group as the replay group whose offsets record what was
// replayed.
func openKafka(ctx context.Context, cfg config, out io.Writer) (*destination, error) {
	switch {
	case cfg.dlt == "":
		return nil, errors.New("-dlt: give the dead-letter topic's name")
	case cfg.group == "":
		return nil, errors.New("-group: name the replay group, whose offsets on the dead-letter topic record what was replayed (a new group starts at the topic's start)")
	}
	var brokers []string
	for _, b := range strings.Split(cfg.brokers, ",") {
		if b = strings.TrimSpace(b); b != "" {
			brokers = append(brokers, b)
		}
	}
	r, err := kafka.NewReplay(ctx, cfg.dlt, kafka.WithBrokers(brokers...), kafka.WithGroup(cfg.group))
	if err != nil {
		return nil, err
	}
	return &destination{replayer: r, name: "Kafka topic " + cfg.dlt + " (beyond group " + cfg.group + ")", close: func() { r.Close() },
		skipped: "left out by the selection; the replay group has passed them, and another -group would see them again"}, nil
}
