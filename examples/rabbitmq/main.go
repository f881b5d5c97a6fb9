// Command rabbitmq runs custody on a RabbitMQ queue: a few hundred orders
// handled at concurrency 16, a flaky dependency retried with backoff (the
// runtime holds a failed delivery through its delay without a worker, so no
// worker sits idle and the message never leaves its custody), and a
// malformed order dead-lettered, with its diagnostics, to a dead-letter queue
// through publisher confirms.
//
// It needs a broker; by default the local one with the guest account:
//
//	go run ./examples/rabbitmq -url amqp://guest:guest@127.0.0.1:5672/
//
// The adapter declares the queue (custody-example-orders), and the
// dead-letter sink its exchange, queue and binding; the program deletes them
// when it is done unless -keep is given.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters/rabbitmq"
	"github.com/custody-go/custody/consumer"
)

type order struct {
	ID     int `json:"id"`
	Amount int `json:"amount"`
}

type config struct {
	url    string
	queue  string
	orders int
	keep   bool
}

func main() {
	var cfg config
	flag.StringVar(&cfg.url, "url", "amqp://guest:guest@127.0.0.1:5672/", "AMQP URL of the broker")
	flag.StringVar(&cfg.queue, "queue", "custody-example-orders", "queue to create and consume")
	flag.IntVar(&cfg.orders, "orders", 300, "how many orders to publish")
	flag.BoolVar(&cfg.keep, "keep", false, "keep the queues afterwards")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := run(ctx, cfg, os.Stdout); err != nil {
		log.Fatal(err)
	}
}

const (
	poisonID = 13 // malformed: goes to the dead-letter queue at once
	flakyMod = 25 // orders whose id is a multiple of this fail twice before succeeding
)

func run(ctx context.Context, cfg config, out *os.File) error {
	dlx, dlq := cfg.queue+".dlx", cfg.queue+".dlq"
	if err := emptyKept(cfg, dlq); err != nil {
		return err
	}
	if !cfg.keep {
		defer tearDown(cfg, dlx, dlq)
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	src, err := rabbitmq.New(ctx, cfg.queue,
		rabbitmq.WithURL(cfg.url),
		rabbitmq.WithDeclare(rabbitmq.ClassicQueue, nil), // or QuorumQueue
		rabbitmq.WithPrefetch(64),                        // retries waiting their delay hold a slot each
		rabbitmq.WithLogger(logger))
	if err != nil {
		return err
	}
	// Dead letters go to the exchange dlx with routing key "poison", and
	// from there to the queue dlq: the sink declares all three.
	sink, err := rabbitmq.NewDeadLetter(ctx, dlx, "poison",
		rabbitmq.WithURL(cfg.url),
		rabbitmq.WithDeclareDeadLetter(dlq, rabbitmq.ClassicQueue, nil))
	if err != nil {
		src.Close()
		return err
	}
	defer sink.Close()

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
			return consumer.RetryAfter(errors.New("payment service unavailable"), time.Duration(m.Attempt)*time.Second)
		}
		time.Sleep(2 * time.Millisecond) // the work
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

	if err := publish(ctx, cfg); err != nil {
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

	dead, err := deadLettered(cfg, dlq)
	if err != nil {
		return err
	}
	st := src.Stats()
	fmt.Fprintf(out, "handled %d orders in %v\n", handled.Load(), took.Round(time.Millisecond))
	mu.Lock()
	fmt.Fprintf(out, "order %d succeeded on attempt %d after two retries, each waited out in place\n", flakyMod, attempts[flakyMod])
	mu.Unlock()
	fmt.Fprintf(out, "acks: %d deliveries settled with %d ack frames (%d of them multiple=true)\n", st.Acked, st.AckFrames, st.MultipleAcks)
	fmt.Fprintf(out, "deliveries: %d for %d orders: the retries waited without the broker delivering again\n", st.Delivered, cfg.orders)
	for _, m := range dead {
		fmt.Fprintf(out, "dead-lettered %q: %s=%v %s=%v %s=%v\n", m.Body,
			"custody-error", m.Headers["custody-error"],
			"custody-attempts", m.Headers["custody-attempts"],
			"custody-original-queue", m.Headers["custody-original-queue"])
	}
	if len(dead) != 1 {
		return fmt.Errorf("expected one dead-lettered order, found %d", len(dead))
	}
	return nil
}

// emptyKept empties the queues an earlier run with -keep left, if any, so
// that the counts below are this run's.
func emptyKept(cfg config, dlq string) error {
	return withChannel(cfg, func(ch *amqp.Channel) error {
		for _, q := range []string{cfg.queue, dlq} {
			if _, err := ch.QueueDeclarePassive(q, true, false, false, false, nil); err != nil {
				return nil // not there: this is the first run (the failure closed the channel)
			}
			if _, err := ch.QueuePurge(q, false); err != nil {
				return err
			}
		}
		return nil
	})
}

func tearDown(cfg config, dlx, dlq string) {
	_ = withChannel(cfg, func(ch *amqp.Channel) error {
		for _, q := range []string{cfg.queue, dlq} {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
		return ch.ExchangeDelete(dlx, false, false)
	})
}

// publish sends the orders with publisher confirms; order 13 is malformed.
func publish(ctx context.Context, cfg config) error {
	return withChannel(cfg, func(ch *amqp.Channel) error {
		if err := ch.Confirm(false); err != nil {
			return err
		}
		var last *amqp.DeferredConfirmation
		for i := 1; i <= cfg.orders; i++ {
			body, _ := json.Marshal(order{ID: i, Amount: i * 10})
			if i == poisonID {
				body = []byte(`{"id": 13, "amount": "thirteen"`)
			}
			dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", cfg.queue, true, false, amqp.Publishing{
				MessageId: fmt.Sprintf("order-%d", i), Body: body, ContentType: "application/json",
				DeliveryMode: amqp.Persistent, Timestamp: time.Now(),
			})
			if err != nil {
				return err
			}
			last = dc
		}
		if ok, err := last.WaitContext(ctx); err != nil || !ok {
			return fmt.Errorf("publishing the orders was not confirmed: %v", err)
		}
		return nil
	})
}

type deadMessage struct {
	Body    string
	Headers amqp.Table
}

func deadLettered(cfg config, dlq string) ([]deadMessage, error) {
	var out []deadMessage
	err := withChannel(cfg, func(ch *amqp.Channel) error {
		deadline := time.Now().Add(10 * time.Second)
		for len(out) == 0 && time.Now().Before(deadline) {
			for {
				m, ok, err := ch.Get(dlq, true)
				if err != nil {
					return err
				}
				if !ok {
					break
				}
				out = append(out, deadMessage{Body: string(m.Body), Headers: m.Headers})
			}
			time.Sleep(50 * time.Millisecond)
		}
		return nil
	})
	return out, err
}

func withChannel(cfg config, fn func(*amqp.Channel) error) error {
	conn, err := amqp.Dial(cfg.url)
	if err != nil {
		return fmt.Errorf("connect to %s: %w (is RabbitMQ running?)", "the broker", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	return fn(ch)
}
