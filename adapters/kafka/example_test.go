package kafka_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"time"

	"github.com/custody-go/custody/adapters/kafka"
	"github.com/custody-go/custody/consumer"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// A consumer group over one topic, with a dead-letter topic beside it. The
// example runs against an in-process kfake cluster; give real broker
// addresses instead.
func Example() {
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "payments", "payments.dlq"))
	if err != nil {
		log.Fatal(err)
	}
	defer cluster.Close()
	brokers := cluster.ListenAddrs()

	producer, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		log.Fatal(err)
	}
	defer producer.Close()
	for _, v := range []string{"one", "two", "three"} {
		r := &kgo.Record{Topic: "payments", Key: []byte("customer-1"), Value: []byte(v)}
		if err := producer.ProduceSync(context.Background(), r).FirstErr(); err != nil {
			log.Fatal(err)
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	src, err := kafka.New(ctx, // reaches the cluster, or fails with the reason
		kafka.WithBrokers(brokers...),
		kafka.WithGroup("payments-service"),
		kafka.WithTopics("payments"),
		kafka.WithOrderingScope(kafka.ByKey),
	)
	if err != nil {
		log.Fatal(err)
	}
	dlq, err := src.NewDeadLetter(ctx, "payments.dlq")
	if err != nil {
		log.Fatal(err)
	}
	defer dlq.Close()

	seen := 0
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		fmt.Printf("%s: %s\n", m.Key, m.Body)
		if seen++; seen == 3 {
			cancel() // stop after three: drain, commit, close
		}
		return nil
	}), consumer.WithConcurrency(16), consumer.WithDeadLetter(dlq),
		consumer.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Run(ctx); err != nil {
		log.Fatal(err)
	}
	// Output:
	// customer-1: one
	// customer-1: two
	// customer-1: three
}
