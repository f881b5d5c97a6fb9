// Command kafka runs custody on a Kafka topic: orders from a hundred
// customers over eight partitions, handled at concurrency 64 with by-key
// ordering (one customer's orders in order, different customers at once), a
// flaky dependency retried in place, and a malformed order dead-lettered with
// its diagnostics to a dead-letter topic. At the end it reads the group's
// committed offsets back: they stand at the end of every partition.
//
// With no brokers it starts an embedded, in-process Kafka cluster (franz-go's
// kfake), so it runs on a fresh machine:
//
//	go run ./examples/kafka
//	go run ./examples/kafka -brokers kafka-1:9092,kafka-2:9092
//
// Against real brokers it creates its topics (custody-example-orders and
// custody-example-orders.dlq) when they do not exist, and uses a fresh group.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/custody-go/custody/adapters/kafka"
	"github.com/custody-go/custody/consumer"
)

type order struct {
	Run      int64  `json:"run"` // orders of earlier runs on real brokers are skipped
	ID       int    `json:"id"`
	Customer string `json:"customer"`
	Seq      int    `json:"seq"` // the customer's own order sequence
}

type config struct {
	brokers    string
	topic      string
	orders     int
	partitions int
}

const (
	customers = 100
	poisonID  = 13 // malformed: goes to the dead-letter topic at once
	flakyMod  = 50 // orders whose id is a multiple of this fail once
)

func main() {
	var cfg config
	flag.StringVar(&cfg.brokers, "brokers", "", "comma-separated broker addresses; empty starts an embedded cluster")
	flag.StringVar(&cfg.topic, "topic", "custody-example-orders", "topic to create and consume")
	flag.IntVar(&cfg.orders, "orders", 2000, "how many orders to produce")
	flag.IntVar(&cfg.partitions, "partitions", 8, "partitions of the topic when it is created")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := run(ctx, cfg, os.Stdout); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, cfg config, out io.Writer) error {
	brokers := splitList(cfg.brokers)
	if len(brokers) == 0 {
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
		if err != nil {
			return fmt.Errorf("starting the embedded cluster: %w", err)
		}
		defer cluster.Close()
		brokers = cluster.ListenAddrs()
		fmt.Fprintf(out, "no -brokers given: started an embedded Kafka cluster at %s\n", strings.Join(brokers, ","))
	}
	dlqTopic := cfg.topic + ".dlq"
	runID := time.Now().UnixNano()
	group := fmt.Sprintf("custody-example-%d", runID)

	admin, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return err
	}
	defer admin.Close()
	adm := kadm.NewClient(admin)
	if err := createTopics(ctx, adm, int32(cfg.partitions), cfg.topic, dlqTopic); err != nil {
		return err
	}
	start, err := adm.ListEndOffsets(ctx, cfg.topic)
	if err != nil {
		return err
	}
	if err := produce(ctx, admin, cfg, runID); err != nil {
		return err
	}
	end, err := adm.ListEndOffsets(ctx, cfg.topic)
	if err != nil {
		return err
	}

	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	src, err := kafka.New(ctx,
		kafka.WithBrokers(brokers...),
		kafka.WithGroup(group),
		kafka.WithTopics(cfg.topic),
		kafka.WithOrderingScope(kafka.ByKey),
		kafka.WithCommitInterval(500*time.Millisecond),
		kafka.WithLogger(logger),
	)
	if err != nil {
		return err
	}
	dlq, err := src.NewDeadLetter(ctx, dlqTopic)
	if err != nil {
		src.Close()
		return err
	}
	defer dlq.Close()

	var (
		handled atomic.Int64
		mu      sync.Mutex
		lastSeq = map[string]int{}
		bad     []string // order violations
		done    = make(chan struct{})
		once    sync.Once
	)
	want := int64(cfg.orders - 1) // all but the poison order
	handler := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		var o order
		if err := json.Unmarshal(m.Body, &o); err != nil {
			return consumer.Permanent(fmt.Errorf("order is not valid JSON: %w", err))
		}
		if o.Run != runID {
			return nil // an earlier run's order, still in the topic
		}
		if o.ID%flakyMod == 0 && m.Attempt == 1 {
			return errors.New("inventory service unavailable") // retried in place, its customer's lane waits
		}
		time.Sleep(time.Millisecond) // the work
		mu.Lock()
		if o.Seq <= lastSeq[o.Customer] {
			bad = append(bad, fmt.Sprintf("%s: %d after %d", o.Customer, o.Seq, lastSeq[o.Customer]))
		}
		lastSeq[o.Customer] = o.Seq
		mu.Unlock()
		if handled.Add(1) == want {
			once.Do(func() { close(done) })
		}
		return nil
	})
	c, err := consumer.New(src, handler,
		consumer.WithConcurrency(64),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 5, Backoff: consumer.ConstantBackoff(20 * time.Millisecond)}),
		consumer.WithDeadLetter(dlq),
		consumer.WithLogger(logger))
	if err != nil {
		src.Close()
		return err
	}

	runCtx, stop := context.WithCancel(ctx)
	ran := make(chan error, 1)
	began := time.Now()
	go func() { ran <- c.Run(runCtx) }()
	select {
	case <-done:
	case err := <-ran:
		stop()
		return fmt.Errorf("consumer stopped early: %w", err)
	case <-ctx.Done():
		stop()
		<-ran
		return fmt.Errorf("handled %d of %d orders before giving up: %w", handled.Load(), want, ctx.Err())
	}
	took := time.Since(began)
	stop() // drain, commit the done prefixes, leave the group
	if err := <-ran; err != nil {
		return err
	}

	fmt.Fprintf(out, "handled %d orders from %d customers in %v (1ms of work each, concurrency 64, by-key order)\n",
		handled.Load(), customers, took.Round(time.Millisecond))
	if len(bad) > 0 {
		return fmt.Errorf("orders of one customer ran out of order: %v", bad[:min(5, len(bad))])
	}
	fmt.Fprintln(out, "every customer's orders ran in sequence")

	if err := reportCommitted(ctx, adm, group, cfg.topic, start, end, out); err != nil {
		return err
	}
	return reportDeadLetters(ctx, adm, brokers, dlqTopic, out)
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func createTopics(ctx context.Context, adm *kadm.Client, partitions int32, topics ...string) error {
	resp, err := adm.CreateTopics(ctx, partitions, 1, nil, topics...)
	if err != nil {
		return err
	}
	for _, r := range resp.Sorted() {
		if r.Err != nil && !errors.Is(r.Err, kerr.TopicAlreadyExists) {
			return fmt.Errorf("creating topic %s: %w", r.Topic, r.Err)
		}
	}
	return nil
}

// produce writes the orders keyed by customer, so each customer's orders
// share a partition; order 13 is malformed.
func produce(ctx context.Context, cl *kgo.Client, cfg config, runID int64) error {
	seq := map[string]int{}
	rs := make([]*kgo.Record, 0, cfg.orders)
	for id := 1; id <= cfg.orders; id++ {
		customer := fmt.Sprintf("customer-%03d", id%customers)
		seq[customer]++
		body, _ := json.Marshal(order{Run: runID, ID: id, Customer: customer, Seq: seq[customer]})
		if id == poisonID {
			body = []byte(`{"id": 13, "customer": `) // truncated
		}
		rs = append(rs, &kgo.Record{Topic: cfg.topic, Key: []byte(customer), Value: body,
			Headers: []kgo.RecordHeader{{Key: "source", Value: []byte("examples/kafka")}}})
	}
	return cl.ProduceSync(ctx, rs...).FirstErr()
}

// reportCommitted reads the group's committed offsets and checks that they
// reached the end of what this run produced in every partition.
func reportCommitted(ctx context.Context, adm *kadm.Client, group, topic string, start, end kadm.ListedOffsets, out io.Writer) error {
	committed, err := adm.FetchOffsets(ctx, group)
	if err != nil {
		return err
	}
	var parts []int32
	end.Each(func(o kadm.ListedOffset) { parts = append(parts, o.Partition) })
	sort.Slice(parts, func(i, j int) bool { return parts[i] < parts[j] })
	var line []string
	for _, p := range parts {
		e, _ := end.Lookup(topic, p)
		s, _ := start.Lookup(topic, p)
		if e.Offset == s.Offset {
			continue // nothing produced here this run
		}
		c, ok := committed.Lookup(topic, p)
		if !ok || c.At != e.Offset {
			return fmt.Errorf("partition %d committed at %d, want its end %d", p, c.At, e.Offset)
		}
		line = append(line, fmt.Sprintf("%d:%d", p, c.At))
	}
	fmt.Fprintf(out, "committed offsets at the end of every partition: %s\n", strings.Join(line, " "))
	return nil
}

// reportDeadLetters prints the dead letters of the topic. It first asks
// where the topic ends, so that "nothing was written" and "written but not
// read back" fail apart, and then reads the partitions that hold records
// from their start.
func reportDeadLetters(ctx context.Context, adm *kadm.Client, brokers []string, topic string, out io.Writer) error {
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err != nil {
		return err
	}
	starts, err := adm.ListStartOffsets(ctx, topic)
	if err != nil {
		return err
	}
	parts := map[int32]kgo.Offset{}
	ends.Each(func(e kadm.ListedOffset) {
		if s, ok := starts.Lookup(topic, e.Partition); ok && e.Offset > s.Offset {
			parts[e.Partition] = kgo.NewOffset().At(s.Offset)
		}
	})
	if len(parts) == 0 {
		return errors.New("the malformed order did not reach the dead-letter topic: it holds no records")
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: parts}),
		kgo.FetchMaxWait(500*time.Millisecond))
	if err != nil {
		return err
	}
	defer cl.Close()
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var found int
	for found == 0 && pctx.Err() == nil {
		cl.PollFetches(pctx).EachRecord(func(r *kgo.Record) {
			h := map[string]string{}
			for _, rh := range r.Headers {
				h[rh.Key] = string(rh.Value)
			}
			found++
			fmt.Fprintf(out, "dead-lettered %q: custody-error=%q custody-attempts=%s original=%s/%s/%s custody-group=%s source=%s\n",
				r.Value, h["custody-error"], h["custody-attempts"], h["custody-original-queue"],
				h["custody-original-partition"], h["custody-original-offset"], h[kafka.HeaderGroup], h["source"])
		})
	}
	if found == 0 {
		return fmt.Errorf("the dead-letter topic holds records (partitions %v) but none could be read back: %w", parts, pctx.Err())
	}
	return nil
}
