// Command jetstream runs custody on a NATS JetStream stream: a few hundred
// orders handled at concurrency 16 through a durable pull consumer, a flaky
// dependency retried with backoff (each retry a nak with the delay the
// policy picked, so it waits in the server, not in a worker), a slow order
// whose lease (the consumer's AckWait) is renewed with InProgress while it
// works, and a malformed order dead-lettered, with its diagnostics, to a
// dead-letter stream that confirms the copy before the original is
// terminated.
//
// It needs a server with JetStream; by default the local one:
//
//	go run ./examples/jetstream -url nats://127.0.0.1:4222
//
// It creates its streams (custody_example_orders and, beside it,
// custody_example_orders_dlq) and deletes them when it is done unless
// -keep is given.
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
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	custodyjs "github.com/custody-go/custody/adapters/jetstream"
	"github.com/custody-go/custody/consumer"
)

type order struct {
	ID     int    `json:"id"`
	Region string `json:"region"`
	Amount int    `json:"amount"`
}

type config struct {
	url    string
	stream string
	orders int
	keep   bool
}

func main() {
	var cfg config
	flag.StringVar(&cfg.url, "url", nats.DefaultURL, "URL of the NATS server (JetStream enabled)")
	flag.StringVar(&cfg.stream, "stream", "custody_example_orders", "stream to create and consume")
	flag.IntVar(&cfg.orders, "orders", 300, "how many orders to publish")
	flag.BoolVar(&cfg.keep, "keep", false, "keep the streams afterwards")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := run(ctx, cfg, os.Stdout); err != nil {
		log.Fatal(err)
	}
}

const (
	poisonID = 13 // malformed: dead-lettered at once
	slowID   = 42 // works for longer than the lease
	flakyMod = 25 // orders whose id is a multiple of this fail twice before succeeding
	ackWait  = 2 * time.Second
)

var regions = []string{"eu", "us", "ap"}

func run(ctx context.Context, cfg config, out io.Writer) error {
	nc, err := nats.Connect(cfg.url, nats.Name("custody-example"), nats.MaxReconnects(-1))
	if err != nil {
		return fmt.Errorf("connect to %s: %w (is nats-server -js running?)", cfg.url, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	dlqStream := cfg.stream + "_dlq"
	if err := setUp(ctx, js, cfg.stream, dlqStream); err != nil {
		return err
	}
	if !cfg.keep {
		defer func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			js.DeleteStream(ctx, cfg.stream)
			js.DeleteStream(ctx, dlqStream)
		}()
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	// Orders are published on <stream>.<region>: the subject is each
	// message's Key, so consumer.WithOrdering(consumer.OrderByKey) would
	// handle one order per region at a time, in stream order (and retry in
	// place, since a nak would let the region's later orders overtake).
	src, err := custodyjs.New(ctx, js, cfg.stream, "shipper",
		custodyjs.WithCreate(jetstream.ConsumerConfig{AckWait: ackWait, MaxAckPending: 256}))
	if err != nil {
		return err
	}
	sink, err := custodyjs.NewDeadLetter(ctx, js, dlqStream+".shipper")
	if err != nil {
		src.Close()
		return err
	}

	var (
		handled  atomic.Int64
		mu       sync.Mutex
		attempts = map[int]int{}
		done     = make(chan struct{})
		once     sync.Once
	)
	want := int64(cfg.orders - 1) // all but the poison order
	handler := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		var o order
		if err := json.Unmarshal(m.Body, &o); err != nil {
			return consumer.Permanent(fmt.Errorf("order is not valid JSON: %w", err))
		}
		mu.Lock()
		attempts[o.ID] = m.Attempt
		mu.Unlock()
		if o.ID%flakyMod == 0 && m.Attempt < 3 {
			return consumer.RetryAfter(errors.New("payment service unavailable"), 300*time.Millisecond)
		}
		work := 2 * time.Millisecond
		if o.ID == slowID {
			work = 2 * ackWait // the lease is renewed meanwhile
		}
		select {
		case <-time.After(work):
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		if handled.Add(1) == want {
			once.Do(func() { close(done) })
		}
		return nil
	})
	c, err := consumer.New(src, handler,
		consumer.WithConcurrency(16),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 5}),
		consumer.WithDeadLetter(sink),
		consumer.WithLogger(logger))
	if err != nil {
		src.Close()
		return err
	}

	if err := publish(ctx, js, cfg); err != nil {
		src.Close()
		return err
	}
	runCtx, stop := context.WithCancel(ctx)
	ran := make(chan error, 1)
	start := time.Now()
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
	took := time.Since(start)
	stop()
	if err := <-ran; err != nil {
		return err
	}

	dead, err := deadLettered(ctx, js, dlqStream)
	if err != nil {
		return err
	}
	st := src.Stats()
	fmt.Fprintf(out, "handled %d orders in %v\n", handled.Load(), took.Round(time.Millisecond))
	mu.Lock()
	fmt.Fprintf(out, "order %d succeeded on delivery %d after two naks with a delay\n", flakyMod, attempts[flakyMod])
	fmt.Fprintf(out, "order %d worked for %v on a %v AckWait and was delivered %d time(s)\n", slowID, 2*ackWait, ackWait, attempts[slowID])
	mu.Unlock()
	fmt.Fprintf(out, "requests: %d fetches, %d acks, %d naks, %d renewals (InProgress), %d terms\n", st.Fetches, st.Acks, st.Naks, st.Renewals, st.Terms)
	for _, m := range dead {
		fmt.Fprintf(out, "dead-lettered %q: custody-error=%v custody-attempts=%v custody-original-subject=%v\n", m.Data(),
			m.Headers().Get("custody-error"), m.Headers().Get("custody-attempts"), m.Headers().Get("custody-original-subject"))
	}
	if len(dead) != 1 {
		return fmt.Errorf("expected one dead-lettered order, found %d", len(dead))
	}
	return nil
}

// setUp creates the stream and the dead-letter stream, empty.
func setUp(ctx context.Context, js jetstream.JetStream, stream, dlq string) error {
	for _, name := range []string{stream, dlq} {
		_ = js.DeleteStream(ctx, name)
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}}); err != nil {
			return fmt.Errorf("creating stream %s: %w", name, err)
		}
	}
	return nil
}

// publish sends the orders, each confirmed by the stream; order 13 is
// malformed.
func publish(ctx context.Context, js jetstream.JetStream, cfg config) error {
	for i := 1; i <= cfg.orders; i++ {
		region := regions[i%len(regions)]
		body, _ := json.Marshal(order{ID: i, Region: region, Amount: i * 10})
		if i == poisonID {
			body = []byte(`{"id": 13, "amount": "thirteen"`)
		}
		msg := &nats.Msg{Subject: cfg.stream + "." + region, Data: body, Header: nats.Header{}}
		msg.Header.Set("Content-Type", "application/json")
		if _, err := js.PublishMsg(ctx, msg, jetstream.WithMsgID(fmt.Sprintf("order-%d", i))); err != nil {
			return err
		}
	}
	return nil
}

// deadLettered reads the dead-letter stream.
func deadLettered(ctx context.Context, js jetstream.JetStream, stream string) ([]jetstream.Msg, error) {
	c, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return nil, err
	}
	batch, err := c.Fetch(10, jetstream.FetchMaxWait(time.Second))
	if err != nil {
		return nil, err
	}
	var out []jetstream.Msg
	for m := range batch.Messages() {
		out = append(out, m)
	}
	return out, batch.Error()
}
