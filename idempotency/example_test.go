package idempotency_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
)

// A message delivered twice is charged once: the second delivery finds its
// key completed and is acked without running the handler.
func Example() {
	ctx := context.Background()
	broker := memory.NewBroker()
	_ = broker.CreateQueue("orders", memory.QueueOptions{})
	// The same order published twice, as a producer that retried would.
	order := memory.Message{ID: "order-1001", Body: []byte(`{"total": 42}`)}
	_ = broker.Publish(ctx, "orders", order, order)

	store, _ := idempotency.NewMemoryStore() // redisstore or pgstore to share between processes
	dedup, err := idempotency.New(store, idempotency.WithFingerprint(idempotency.FingerprintBody))
	if err != nil {
		panic(err)
	}
	var charges atomic.Int32
	charge := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		charges.Add(1) // the effect: call the payment provider, write a row...
		return nil
	})

	src, _ := broker.Source("orders")
	c, err := consumer.New(src, consumer.Chain(charge, dedup), consumer.WithLogger(quiet))
	if err != nil {
		panic(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	for st, _ := broker.Stats("orders"); st.Visible+st.InFlight > 0; st, _ = broker.Stats("orders") {
		time.Sleep(time.Millisecond)
	}
	stop()
	<-done
	fmt.Println("charged", charges.Load(), "time(s)")
	// Output: charged 1 time(s)
}
