// Command crash shows what at-least-once means, on the embedded memory
// broker: a consumer dies in the middle of its work, a second one takes over,
// and no message is lost, but the effects the first one completed without
// acking run again. Then it runs the same crash with the idempotency
// middleware in front of the handler, and the repeats disappear.
//
//	go run ./examples/crash
package main

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
)

const (
	messages = 1000
	lease    = 200 * time.Millisecond
)

func main() {
	plain, err := crashOnce(false)
	if err != nil {
		log.Fatal(err)
	}
	dedup, err := crashOnce(true)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("custody crash demonstration: %d messages, the first consumer killed mid-stream\n\n", messages)
	fmt.Printf("  %-30s %8s %10s %12s\n", "", "lost", "repeated", "by the crash")
	fmt.Printf("  %-30s %8d %10d %12d\n", "plain handler", plain.lost, plain.repeated, plain.unacked)
	fmt.Printf("  %-30s %8d %10d %12d\n", "with idempotency middleware", dedup.lost, dedup.repeated, dedup.unacked)
	fmt.Println()
	fmt.Println("  lost:         messages whose effect never ran (always 0: the broker redelivers what was not acked)")
	fmt.Println("  repeated:     messages whose effect ran more than once")
	fmt.Println("  by the crash: effects the first consumer completed whose ack never reached the broker")
	if plain.lost != 0 || dedup.lost != 0 || dedup.repeated != 0 {
		os.Exit(1)
	}
}

type outcome struct{ lost, repeated, unacked int }

// crashOnce runs a consumer until it has applied a third of the messages,
// kills it, lets a second consumer finish the queue, and counts.
func crashOnce(withDedup bool) (outcome, error) {
	ctx := context.Background()
	broker := memory.NewBroker()
	if err := broker.CreateQueue("jobs", memory.QueueOptions{Lease: lease}); err != nil {
		return outcome{}, err
	}
	for i := 0; i < messages; i++ {
		if err := broker.Publish(ctx, "jobs", memory.Message{ID: fmt.Sprintf("job-%d", i), Body: []byte("work")}); err != nil {
			return outcome{}, err
		}
	}

	var (
		mu      sync.Mutex
		applied = map[string]int{}
	)
	effect := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		time.Sleep(time.Millisecond) // the work
		mu.Lock()
		applied[m.ID]++
		mu.Unlock()
		return nil
	})
	handler := consumer.Handler(effect)
	if withDedup {
		// One store shared by both consumers, as Redis or PostgreSQL would be
		// shared by two processes.
		store, err := idempotency.NewMemoryStore()
		if err != nil {
			return outcome{}, err
		}
		mw, err := idempotency.New(store, idempotency.WithLease(lease), idempotency.WithOverlapRetryDelay(lease/2))
		if err != nil {
			return outcome{}, err
		}
		handler = consumer.Chain(effect, mw)
	}
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError + 4}))
	count := func() int { mu.Lock(); defer mu.Unlock(); return len(applied) }

	// The first consumer: killed once a third of the effects ran.
	first, err := broker.Source("jobs", memory.WithPollWait(20*time.Millisecond))
	if err != nil {
		return outcome{}, err
	}
	c1, err := consumer.New(first, handler, consumer.WithConcurrency(16), consumer.WithLogger(quiet))
	if err != nil {
		return outcome{}, err
	}
	done1 := make(chan error, 1)
	go func() { done1 <- c1.Run(ctx) }()
	for count() < messages/3 {
		time.Sleep(time.Millisecond)
	}
	first.Crash() // from here on nothing it does reaches the broker
	<-done1
	stats, _ := broker.Stats("jobs")
	appliedByFirst := count()
	unacked := appliedByFirst - int(stats.Acked)

	// The second consumer finishes the queue.
	second, err := broker.Source("jobs", memory.WithPollWait(20*time.Millisecond))
	if err != nil {
		return outcome{}, err
	}
	c2, err := consumer.New(second, handler, consumer.WithConcurrency(16), consumer.WithLogger(quiet),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 20, Backoff: consumer.ConstantBackoff(lease / 4)}))
	if err != nil {
		return outcome{}, err
	}
	runCtx, stop := context.WithCancel(ctx)
	done2 := make(chan error, 1)
	go func() { done2 <- c2.Run(runCtx) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		s, _ := broker.Stats("jobs")
		if s.Visible == 0 && s.InFlight == 0 {
			break
		}
		if time.Now().After(deadline) {
			stop()
			<-done2
			return outcome{}, fmt.Errorf("the second consumer did not finish the queue: %+v", s)
		}
		time.Sleep(5 * time.Millisecond)
	}
	stop()
	if err := <-done2; err != nil {
		return outcome{}, err
	}

	mu.Lock()
	defer mu.Unlock()
	o := outcome{lost: messages - len(applied), unacked: unacked}
	for _, n := range applied {
		if n > 1 {
			o.repeated++
		}
	}
	return o, nil
}
