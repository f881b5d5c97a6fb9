package pgtx_test

import (
	"context"
	"strconv"
	"testing"
	"time"

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

// BenchmarkBulkInsert is the helper's two forms doing the same work, one
// inserted row per message: "per-message" is Handle, a transaction per
// message; "batch-100" is HandleBatch on batches of 100, one transaction
// and one multi-row INSERT per batch. "plain-tx-batch-100" is the raw
// client's bulk insert, the same transactions without the processed keys.
// An op is one message, so ns/op, allocs/op and cpu-ns/msg (this process's
// CPU time, not the server's) are per message; compare the forms within
// one run:
//
//	go test -run XXX -bench BulkInsert -benchtime 3000x ./idempotency/pgtx/
func BenchmarkBulkInsert(b *testing.B) {
	const size = 100
	b.Run("plain-tx-batch-100", func(b *testing.B) {
		f := newFixture(b)
		ctx := context.Background()
		var batches [][]*consumer.Message
		for i := 0; i < b.N; i += size {
			msgs := make([]*consumer.Message, min(size, b.N-i))
			for j := range msgs {
				msgs[j] = msg("m-"+strconv.Itoa(i+j), "x")
			}
			batches = append(batches, msgs)
		}
		cpu := processCPU()
		b.ReportAllocs()
		b.ResetTimer()
		for _, msgs := range batches {
			err := pgx.BeginFunc(ctx, f.pool, func(tx pgx.Tx) error { return f.bulkInsert(ctx, tx, msgs) })
			if err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		reportCPU(b, processCPU()-cpu)
	})
	b.Run("per-message", func(b *testing.B) {
		f := newFixture(b)
		h := f.handler(b, f.insertEffect)
		ctx := context.Background()
		msgs := make([]*consumer.Message, b.N)
		for i := range msgs {
			msgs[i] = msg("m-"+strconv.Itoa(i), "x")
		}
		cpu := processCPU()
		b.ReportAllocs()
		b.ResetTimer()
		for i := range b.N {
			if err := h.Handle(ctx, msgs[i]); err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		reportCPU(b, processCPU()-cpu)
		if n := f.rows(b, f.effects); n != b.N {
			b.Fatalf("%d rows for %d messages", n, b.N)
		}
	})
	b.Run("batch-100", func(b *testing.B) {
		f := newFixture(b)
		h := f.batchHandler(b, f.insertAll)
		ctx := context.Background()
		var batches []*consumer.Batch
		for i := 0; i < b.N; i += size {
			msgs := make([]*consumer.Message, min(size, b.N-i))
			for j := range msgs {
				msgs[j] = msg("m-"+strconv.Itoa(i+j), "x")
			}
			batches = append(batches, consumer.BatchOf(msgs))
		}
		cpu := processCPU()
		b.ReportAllocs()
		b.ResetTimer()
		for _, batch := range batches {
			if err := h.HandleBatch(ctx, batch); err != nil {
				b.Fatal(err)
			}
		}
		b.StopTimer()
		reportCPU(b, processCPU()-cpu)
		if n := f.rows(b, f.effects); n != b.N {
			b.Fatalf("%d rows for %d messages", n, b.N)
		}
		for _, batch := range batches {
			for _, m := range batch.Messages {
				if err, ok := batch.Result(m); !ok || err != nil {
					b.Fatalf("message %s: outcome %v, %v; want done", m.ID, err, ok)
				}
			}
		}
	})
}

// reportCPU reports cpu, the process's CPU time over b.N messages, per
// message.
func reportCPU(b *testing.B, cpu time.Duration) {
	if cpu > 0 {
		b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/msg")
	}
}
