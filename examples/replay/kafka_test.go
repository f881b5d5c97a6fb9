package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/kafka"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// The Kafka mode on an in-process kfake cluster: five dead letters written
// by the runtime through a DeadLetter sink, listed by error, and the
// outage's three replayed to their topic, in a replay group's transaction.
func TestKafka(t *testing.T) {
	fake, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	defer fake.Close()
	brokers := strings.Join(fake.ListenAddrs(), ",")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	admin, err := kgo.NewClient(kgo.SeedBrokers(fake.ListenAddrs()...), kgo.ProducerLinger(0))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	adm := kadm.NewClient(admin)
	for topic, parts := range map[string]int32{"orders": 3, "orders.dlq": 1} {
		if _, err := adm.CreateTopic(ctx, parts, 1, nil, topic); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 5 {
		rec := &kgo.Record{Topic: "orders", Key: []byte(fmt.Sprint("customer-", i)), Value: []byte(fmt.Sprint(i))}
		if err := admin.ProduceSync(ctx, rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}

	src, err := kafka.New(ctx, kafka.WithBrokers(fake.ListenAddrs()...), kafka.WithGroup("orders"), kafka.WithTopics("orders"),
		kafka.WithPollWait(100*time.Millisecond), kafka.WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	sink, err := src.NewDeadLetter(ctx, "orders.dlq")
	if err != nil {
		t.Fatal(err)
	}
	deadLetters := func() int64 {
		ends, err := adm.ListEndOffsets(ctx, "orders.dlq")
		if err != nil {
			t.Fatal(err)
		}
		o, _ := ends.Lookup("orders.dlq", 0)
		return o.Offset
	}
	deadLetterOrders(t, ctx, src, sink, func() bool { return deadLetters() >= 5 })

	kafkaArgs := []string{"-broker", "kafka", "-brokers", brokers, "-dlt", "orders.dlq", "-group", "orders.dlq-replay"}
	out, err := runWith(t, append(kafkaArgs, "-list", "-error", "unavailable")...)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"5 dead letters in Kafka topic orders.dlq", "3      3 ", "2      0 ", "orders", "payment service unavailable", "invalid order"} {
		if !strings.Contains(out, want) {
			t.Errorf("-list output lacks %q", want)
		}
	}

	out, err = runWith(t, append(kafkaArgs, "-replay", "-error", "unavailable", "-rate", "50")...)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "replayed 3, skipped 2") {
		t.Errorf("-replay output lacks the counts")
	}
	out, err = runWith(t, append(kafkaArgs, "-list")...)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "0 dead letters in Kafka topic orders.dlq") {
		t.Errorf("after the replay, -list output lacks that none is left beyond the group")
	}

	// A read-committed reader of orders finds the five originals and the
	// three copies, each with custody-replay-of and no diagnostics, under
	// its original key.
	reader, err := kgo.NewClient(kgo.SeedBrokers(fake.ListenAddrs()...), kgo.ConsumeTopics("orders"),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Close()
	var copies []*kgo.Record
	originals := 0
	for originals+len(copies) < 8 && ctx.Err() == nil {
		reader.PollFetches(ctx).EachRecord(func(r *kgo.Record) {
			for _, h := range r.Headers {
				if h.Key == adapters.HeaderReplayOf {
					copies = append(copies, r)
					return
				}
			}
			originals++
		})
	}
	if originals != 5 || len(copies) != 3 {
		t.Fatalf("orders holds %d originals and %d copies, want 5 and 3", originals, len(copies))
	}
	for _, cp := range copies {
		if string(cp.Value) >= "3" || string(cp.Key) != "customer-"+string(cp.Value) {
			t.Errorf("replayed %q under key %q", cp.Value, cp.Key)
		}
		for _, h := range cp.Headers {
			if h.Key == adapters.HeaderError || h.Key == kafka.HeaderGroup {
				t.Errorf("the copy of %q carries diagnostic %s", cp.Value, h.Key)
			}
		}
	}
}
