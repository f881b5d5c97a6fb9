package crashbench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters/rabbitmq"
	"github.com/custody-go/custody/internal/testkit/testbroker"
)

var (
	rabbitAddr = testbroker.Addr("CUSTODY_RABBITMQ_ADDR", "127.0.0.1:5672")
	rabbitURL  = "amqp://guest:guest@" + rabbitAddr + "/"
)

// rabbitPrefetch is the raw loop's prefetch: the adapter's default.
const rabbitPrefetch = 256

var rabbitBroker = broker{name: "rabbitmq", open: openRabbit}

// openRabbit declares a fresh durable queue.
func openRabbit(tb testing.TB) *stream {
	tb.Helper()
	testbroker.Dial(tb, "RabbitMQ", rabbitAddr)
	conn, err := amqp.Dial(rabbitURL)
	if err != nil {
		testbroker.Unavailable(tb, "RabbitMQ at "+rabbitAddr, err)
	}
	tb.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		tb.Fatal(err)
	}
	var suffix [4]byte
	rand.Read(suffix[:])
	name := fmt.Sprintf("custody-crashbench-%s-%s", strings.NewReplacer("/", "-", " ", "-").Replace(tb.Name()), hex.EncodeToString(suffix[:]))
	if _, err := ch.QueueDeclare(name, true, false, false, false, nil); err != nil {
		tb.Fatalf("declare %s: %v", name, err)
	}
	tb.Cleanup(func() {
		// On a channel of its own: the test's may be closed by then.
		if ch, err := conn.Channel(); err == nil {
			ch.QueueDelete(name, false, false, false)
		}
	})
	if err := ch.Confirm(false); err != nil {
		tb.Fatal(err)
	}
	return &stream{
		env:     []string{envAddr + "=" + rabbitURL, envQueue + "=" + name},
		publish: func(bodies []string) error { return publishRabbit(ch, name, bodies) },
		// The broker requeues a dead connection's unacked deliveries at
		// once: nothing to settle.
		leftover: func() int { return rabbitLeft(tb, ch, name) },
	}
}

// publishRabbit publishes persistent messages and waits for the broker's
// confirms, a thousand at a time.
func publishRabbit(ch *amqp.Channel, queue string, bodies []string) error {
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	for start := 0; start < len(bodies); start += 1000 {
		var pending []*amqp.DeferredConfirmation
		for _, b := range bodies[start:min(start+1000, len(bodies))] {
			dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false,
				amqp.Publishing{MessageId: b, Body: []byte(b), DeliveryMode: amqp.Persistent})
			if err != nil {
				return fmt.Errorf("publish: %w", err)
			}
			pending = append(pending, dc)
		}
		for _, dc := range pending {
			if ok, err := dc.WaitContext(ctx); !ok || err != nil {
				return fmt.Errorf("publish to %s not confirmed: %v", queue, err)
			}
		}
	}
	return nil
}

// rabbitLeft waits until the queue has no consumer, so that the last
// child's unacked deliveries are back, and returns the messages in it.
func rabbitLeft(tb testing.TB, ch *amqp.Channel, queue string) int {
	deadline := time.Now().Add(hang)
	for {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil {
			tb.Fatalf("inspect %s: %v", queue, err)
		}
		if q.Consumers == 0 {
			return q.Messages
		}
		if time.Now().After(deadline) {
			tb.Fatalf("queue %s still has %d consumers", queue, q.Consumers)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// rabbitCustody is custody's consumer with the adapter's defaults.
func rabbitCustody(ctx context.Context, cfg childConfig, effect func(context.Context, []byte) error) error {
	src, err := rabbitmq.New(ctx, cfg.queue, rabbitmq.WithURL(cfg.addr), rabbitmq.WithLogger(cfg.logger))
	if err != nil {
		return err
	}
	return runCustody(ctx, src, cfg, effect)
}

// rabbitRaw is the loop a user would write with amqp091 alone: concurrency
// workers on one channel (prefetch 256), each doing a delivery's work and
// then acking it alone (multiple=false). On SIGTERM it cancels the consumer
// and handles what the broker had already sent.
func rabbitRaw(ctx context.Context, cfg childConfig, effect func(context.Context, []byte) error) error {
	conn, err := amqp.Dial(cfg.addr)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := ch.Qos(rabbitPrefetch, 0, false); err != nil {
		return err
	}
	const tag = "crashbench-raw"
	deliveries, err := ch.Consume(cfg.queue, tag, false, false, false, false, nil)
	if err != nil {
		return err
	}
	finished := make(chan struct{})
	defer close(finished)
	go func() {
		select {
		case <-ctx.Done():
			ch.Cancel(tag, false)
		case <-finished:
		}
	}()
	var wg sync.WaitGroup
	for range cfg.concurrency {
		wg.Go(func() {
			for d := range deliveries {
				if err := effect(ctx, d.Body); err != nil {
					cfg.logger.Warn("effect", "error", err)
					d.Nack(false, true)
					continue
				}
				if err := d.Ack(false); err != nil {
					cfg.logger.Warn("ack", "error", err)
				}
			}
		})
	}
	wg.Wait()
	return nil
}
