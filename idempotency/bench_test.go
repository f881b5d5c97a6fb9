package idempotency_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/teststores"
)

func noop(context.Context, *consumer.Message) error { return nil }

// BenchmarkHandle is the middleware alone around a no-op handler: one claim
// and one completion of a fresh key per message.
func BenchmarkHandle(b *testing.B) {
	for _, st := range teststores.All() {
		b.Run(st.Name, func(b *testing.B) {
			h := newGuard(b, st.New(b), noop)
			msgs := make([]*consumer.Message, b.N)
			for i := range msgs {
				msgs[i] = msg("m-"+strconv.Itoa(i), "x")
			}
			ctx := context.Background()
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				if err := h.Handle(ctx, msgs[i]); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkRuntime consumes b.N messages from the memory broker with 8
// handlers, without the middleware and with it over each store, so the
// middleware's cost per message reads as a ratio to the plain consumer.
func BenchmarkRuntime(b *testing.B) {
	type variant struct {
		name string
		wrap func(b *testing.B, h consumer.Handler) consumer.Handler
	}
	variants := []variant{{"plain", func(_ *testing.B, h consumer.Handler) consumer.Handler { return h }}}
	for _, st := range teststores.All() {
		variants = append(variants, variant{"idempotent-" + st.Name, func(b *testing.B, h consumer.Handler) consumer.Handler {
			mw, err := idempotency.New(st.New(b))
			if err != nil {
				b.Fatal(err)
			}
			return mw(h)
		}})
	}
	for _, v := range variants {
		b.Run(v.name, func(b *testing.B) {
			br := memory.NewBroker()
			if err := br.CreateQueue("q", memory.QueueOptions{}); err != nil {
				b.Fatal(err)
			}
			msgs := make([]memory.Message, b.N)
			for i := range msgs {
				msgs[i] = memory.Message{ID: "m-" + strconv.Itoa(i), Body: []byte("x")}
			}
			if err := br.Publish(context.Background(), "q", msgs...); err != nil {
				b.Fatal(err)
			}
			h := v.wrap(b, consumer.HandlerFunc(noop))
			b.ReportAllocs()
			b.ResetTimer()
			runUntilDrained(b, br, "q", h, consumer.WithConcurrency(8))
		})
	}
}

// oneByOne hides a store's BatchStore methods: the batch middleware then
// calls it one key at a time.
type oneByOne struct{ idempotency.Store }

// BenchmarkHandleBatch is the batch middleware alone around a no-op batch
// handler, in batches of 100 fresh keys: one claim and one completion per
// key, in one store call per batch ("batch") or one per key
// ("one-by-one", a Store that is no BatchStore). An op is one message.
func BenchmarkHandleBatch(b *testing.B) {
	const size = 100
	for _, st := range teststores.All() {
		for _, mode := range []string{"batch", "one-by-one"} {
			b.Run(st.Name+"/"+mode, func(b *testing.B) {
				store := st.New(b)
				if mode == "one-by-one" {
					store = oneByOne{store}
				}
				h := newBatchGuard(b, store, func(_ context.Context, batch *consumer.Batch) error {
					batch.DoneAll()
					return nil
				})
				batches := make([]*consumer.Batch, 0, b.N/size+1)
				for i := 0; i < b.N; i += size {
					msgs := make([]*consumer.Message, min(size, b.N-i))
					for j := range msgs {
						msgs[j] = msg("m-"+strconv.Itoa(i+j), "x")
					}
					batches = append(batches, consumer.BatchOf(msgs))
				}
				ctx := context.Background()
				b.ReportAllocs()
				b.ResetTimer()
				for _, batch := range batches {
					if err := h.HandleBatch(ctx, batch); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
