package crashbench

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/custody-go/custody/adapters/kafka"
)

// kafkaPartitions is the topic's partition count: with custody's default
// ordering (one record at a time per partition), as many as the
// concurrency.
const kafkaPartitions = concurrency

var kafkaBroker = broker{name: "kafka", open: openKafka}

var kafkaSeq atomic.Int64

// openKafka starts a kfake cluster in the parent, which outlives the
// children it kills, and creates a topic. Records go to its partitions in
// turn.
func openKafka(tb testing.TB) *stream {
	tb.Helper()
	fake, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		tb.Fatalf("starting kfake: %v", err)
	}
	addrs := fake.ListenAddrs()
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		fake.Close()
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		cl.Close()
		fake.Close()
	})
	adm := kadm.NewClient(cl)
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	seq := kafkaSeq.Add(1)
	topic, group := fmt.Sprintf("crashbench-%d", seq), fmt.Sprintf("crashbench-group-%d", seq)
	if resp, err := adm.CreateTopic(ctx, kafkaPartitions, 1, nil, topic); err != nil || resp.Err != nil {
		tb.Fatalf("creating topic %s: %v %v", topic, err, resp.Err)
	}
	var next atomic.Int64 // the partition of the next record
	return &stream{
		env: []string{envAddr + "=" + strings.Join(addrs, ","), envQueue + "=" + topic,
			envGroup + "=" + group},
		publish: func(bodies []string) error {
			ctx, cancel := context.WithTimeout(context.Background(), hang)
			defer cancel()
			rs := make([]*kgo.Record, len(bodies))
			for i, b := range bodies {
				rs[i] = &kgo.Record{Topic: topic, Partition: int32(next.Add(1) % kafkaPartitions), Value: []byte(b)}
			}
			return cl.ProduceSync(ctx, rs...).FirstErr()
		},
		leftover: func() int { return kafkaLag(tb, adm, group, topic) },
	}
}

// kafkaLag returns the records of topic past the group's committed offsets.
func kafkaLag(tb testing.TB, adm *kadm.Client, group, topic string) int {
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err != nil {
		tb.Fatalf("end offsets: %v", err)
	}
	committed, err := adm.FetchOffsets(ctx, group)
	if err != nil {
		tb.Fatalf("committed offsets: %v", err)
	}
	lag := 0
	ends.Each(func(o kadm.ListedOffset) {
		at := int64(0)
		if c, ok := committed.Lookup(topic, o.Partition); ok && c.At >= 0 {
			at = c.At
		}
		lag += int(o.Offset - at)
	})
	return lag
}

// kafkaMember makes each child a static member of the group (KIP-345):
// a child started after a kill takes over the killed one's partitions at
// once instead of waiting for its session to time out. It changes when the
// records come back, not which.
func kafkaMember(cfg childConfig) kgo.Opt { return kgo.InstanceID(cfg.group + "-member") }

// kafkaCustody is custody's consumer with the adapter's defaults (one
// record at a time per partition, commits a linger after records are done).
func kafkaCustody(ctx context.Context, cfg childConfig, effect func(context.Context, []byte) error) error {
	src, err := kafka.New(ctx,
		kafka.WithBrokers(strings.Split(cfg.addr, ",")...),
		kafka.WithGroup(cfg.group),
		kafka.WithTopics(cfg.queue),
		kafka.WithClientOptions(kafkaMember(cfg)))
	if err != nil {
		return err
	}
	return runCustody(ctx, src, cfg, effect)
}

// kafkaRaw is the loop a user would write with franz-go alone: poll up to
// concurrency records, do their work concurrently, and commit them
// (CommitRecords, synchronously) before the next poll. It keeps no order
// within a partition.
func kafkaRaw(ctx context.Context, cfg childConfig, effect func(context.Context, []byte) error) error {
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(strings.Split(cfg.addr, ",")...),
		kgo.ConsumerGroup(cfg.group),
		kgo.ConsumeTopics(cfg.queue),
		kgo.DisableAutoCommit(),
		kafkaMember(cfg))
	if err != nil {
		return err
	}
	defer cl.Close()
	done := context.WithoutCancel(ctx) // the records in hand finish
	for ctx.Err() == nil {
		fs := cl.PollRecords(ctx, cfg.concurrency)
		fs.EachError(func(topic string, p int32, err error) {
			if ctx.Err() == nil {
				cfg.logger.Warn("fetch", "topic", topic, "partition", p, "error", err)
			}
		})
		recs := fs.Records()
		if len(recs) == 0 {
			continue
		}
		var (
			wg     sync.WaitGroup
			failed atomic.Bool
		)
		for _, r := range recs {
			wg.Go(func() {
				if err := effect(done, r.Value); err != nil {
					failed.Store(true)
				}
			})
		}
		wg.Wait()
		if failed.Load() {
			// Nothing to commit past an effect that did not happen.
			return fmt.Errorf("an effect failed: the parent is gone")
		}
		if err := cl.CommitRecords(done, recs...); err != nil {
			cfg.logger.Warn("commit", "error", err)
		}
	}
	return nil
}
