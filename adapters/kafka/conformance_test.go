package kafka_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/adaptertest"
	"github.com/custody-go/custody/adapters/kafka"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

func TestConformance(t *testing.T) {
	adaptertest.Run(t, adaptertest.Harness{
		NewQueue: newTestQueue,
		Dispatch: adaptertest.Partitions,
	})
}

var queueSeq atomic.Int64

// newTestQueue starts a kfake cluster with a three-partition topic and its
// dead-letter topic. Kafka does not lease records: Queue.Lease is zero.
func newTestQueue(t *testing.T, cfg adaptertest.QueueConfig) *adaptertest.Queue {
	fake, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatalf("starting kfake: %v", err)
	}
	t.Cleanup(fake.Close)
	addrs := fake.ListenAddrs()
	n := queueSeq.Add(1)
	topic, dlqTopic, group := fmt.Sprintf("q%d", n), fmt.Sprintf("q%d.dlq", n), fmt.Sprintf("g%d", n)

	prod, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.ProducerLinger(0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(prod.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := kadm.NewClient(prod).CreateTopic(ctx, 3, 1, nil, topic); err != nil {
		t.Fatal(err)
	}
	if _, err := kadm.NewClient(prod).CreateTopic(ctx, 1, 1, nil, dlqTopic); err != nil {
		t.Fatal(err)
	}
	dl, err := kafka.NewDeadLetter(ctx, dlqTopic, kafka.WithBrokers(addrs...), kafka.WithGroup(group))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dl.Close() })

	reader, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.ConsumeTopics(dlqTopic), kgo.FetchMaxWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(reader.Close)
	var (
		mu   sync.Mutex
		dead []adaptertest.Message
	)
	// Records without a key share one lane per partition in ByKey mode, and
	// the suite's unordered tests publish without keys: they get Unordered.
	ordering := kafka.Unordered
	if cfg.Ordered {
		ordering = kafka.ByKey
	}

	return &adaptertest.Queue{
		Publish: func(ctx context.Context, msgs ...adaptertest.Message) error {
			rs := make([]*kgo.Record, len(msgs))
			for i, m := range msgs {
				r := &kgo.Record{Topic: topic, Value: m.Body}
				if m.Key != "" {
					r.Key = []byte(m.Key)
				}
				for k, v := range m.Headers {
					r.Headers = append(r.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)})
				}
				rs[i] = r
			}
			return prod.ProduceSync(ctx, rs...).FirstErr()
		},
		Open: func(t *testing.T) adapters.Source {
			src, err := kafka.New(context.Background(),
				kafka.WithBrokers(addrs...), kafka.WithGroup(group), kafka.WithTopics(topic),
				kafka.WithOrderingScope(ordering), kafka.WithPollWait(100*time.Millisecond),
				kafka.WithCommitInterval(50*time.Millisecond), kafka.WithRevokeDrain(time.Second),
				kafka.WithClientOptions(kgo.FetchMaxWait(50*time.Millisecond)),
			)
			if err != nil {
				t.Fatal(err)
			}
			return src
		},
		DeadLetter: dl,
		DeadLettered: func(ctx context.Context) ([]adaptertest.Message, error) {
			pctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			defer cancel()
			fs := reader.PollFetches(pctx)
			mu.Lock()
			defer mu.Unlock()
			fs.EachRecord(func(r *kgo.Record) {
				m := adaptertest.Message{Key: string(r.Key), Body: r.Value, Headers: map[string]string{}}
				for _, h := range r.Headers {
					m.Headers[h.Key] = string(h.Value)
				}
				dead = append(dead, m)
			})
			return append([]adaptertest.Message(nil), dead...), nil
		},
	}
}
