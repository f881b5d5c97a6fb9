package pgtx_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/custody-go/custody/consumer"
)

// BenchmarkEffect compares one effect (an INSERT) committed in a plain
// transaction with the same effect committed through the helper, which adds
// the processed-key row and its check to the transaction.
func BenchmarkEffect(b *testing.B) {
	b.Run("plain-tx", func(b *testing.B) {
		f := newFixture(b)
		ctx := context.Background()
		b.ReportAllocs()
		b.ResetTimer()
		for i := range b.N {
			err := pgx.BeginFunc(ctx, f.pool, func(tx pgx.Tx) error {
				return f.insertEffect(ctx, tx, msg("m-"+strconv.Itoa(i), "x"))
			})
			if err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("pgtx", func(b *testing.B) {
		f := newFixture(b)
		h := f.handler(b, f.insertEffect)
		ctx := context.Background()
		msgs := make([]*consumer.Message, b.N)
		for i := range msgs {
			msgs[i] = msg("m-"+strconv.Itoa(i), "x")
		}
		b.ReportAllocs()
		b.ResetTimer()
		for i := range b.N {
			if err := h.Handle(ctx, msgs[i]); err != nil {
				b.Fatal(err)
			}
		}
	})
}
