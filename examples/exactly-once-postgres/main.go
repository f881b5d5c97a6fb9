// Command exactly-once-postgres applies payments from a queue to account
// balances in PostgreSQL exactly once, although the queue delivers some
// payments twice and some acks are lost.
//
// It uses the embedded memory broker, so PostgreSQL is all it needs; without
// DATABASE_URL it connects to postgres://postgres@127.0.0.1:5432/test:
//
//	go run ./examples/exactly-once-postgres
//	DATABASE_URL=postgres://user@host:5432/db go run ./examples/exactly-once-postgres
//
// Each payment's effect (a ledger row and a balance update) and the record
// that the payment was processed commit in one transaction (package pgtx);
// the runtime acks the message only after that commit. A redelivered payment
// finds its record and is skipped, so the totals come out right however
// often it arrives. Swap the memory broker for any custody adapter (SQS,
// RabbitMQ, Kafka) and nothing else changes.
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/pgtx"
)

const (
	payments = 1000
	accounts = 10
	queue    = "payments"
)

func main() {
	if err := run(context.Background()); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context) error {
	dsn := os.Getenv("DATABASE_URL")
	if dsn == "" {
		dsn = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := setUp(ctx, pool); err != nil {
		return fmt.Errorf("setting up tables (is PostgreSQL running at %s?): %w", dsn, err)
	}

	// Duplicates are counted in OpenTelemetry; read them back at the end.
	reader := sdkmetric.NewManualReader()
	meters := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer meters.Shutdown(ctx)

	// The effect: a ledger row and a balance update, both through tx.
	apply, err := pgtx.New(pool, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		account, amount, err := parsePayment(m.Body)
		if err != nil {
			return consumer.Permanent(err) // unparseable: dead-letter it, do not retry
		}
		if _, err := tx.Exec(ctx, `INSERT INTO example_ledger (payment_id, account, amount) VALUES ($1, $2, $3)`, m.ID, account, amount); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `UPDATE example_accounts SET balance = balance + $2 WHERE id = $1`, account, amount)
		return err
	},
		pgtx.WithTable("example_processed"),
		pgtx.WithFingerprint(idempotency.FingerprintBody), // a reused id with another body is a bug: dead-letter it
		pgtx.WithMeterProvider(meters),
	)
	if err != nil {
		return err
	}
	if err := apply.CreateSchema(ctx); err != nil {
		return err
	}

	// The queue: every payment once, a fifth of them twice (a producer
	// that retried its publish), and one ack in ten lost.
	broker := memory.NewBroker()
	if err := broker.CreateQueue(queue, memory.QueueOptions{Lease: time.Second}); err != nil {
		return err
	}
	var want int64
	for i := range payments {
		amount := int64(i%7 + 1)
		want += amount
		m := memory.Message{ID: "payment-" + strconv.Itoa(i), Body: fmt.Appendf(nil, "%d:%d", i%accounts, amount)}
		copies := 1
		if i%5 == 0 {
			copies = 2
		}
		for range copies {
			if err := broker.Publish(ctx, queue, m); err != nil {
				return err
			}
		}
	}
	var lostAcks atomic.Int64
	src, err := broker.Source(queue, memory.WithFaults(memory.Faults{Ack: func(*adapters.Delivery) error {
		if rand.N(10) == 0 {
			lostAcks.Add(1)
			return errors.New("ack lost on the way to the broker")
		}
		return nil
	}}))
	if err != nil {
		return err
	}
	dlq, err := deadLetters(broker)
	if err != nil {
		return err
	}
	c, err := consumer.New(src, apply,
		consumer.WithConcurrency(16),
		consumer.WithDeadLetter(dlq),
		consumer.WithLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))),
	)
	if err != nil {
		return err
	}

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	start := time.Now()
	for {
		st, err := broker.Stats(queue)
		if err != nil {
			return err
		}
		if st.Visible == 0 && st.InFlight == 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	if err := <-done; err != nil {
		return err
	}

	var ledgerRows, total int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM example_ledger`).Scan(&ledgerRows); err != nil {
		return err
	}
	if err := pool.QueryRow(ctx, `SELECT sum(balance) FROM example_accounts`).Scan(&total); err != nil {
		return err
	}
	st, _ := broker.Stats(queue)
	seq, overlap := duplicates(ctx, reader)
	fmt.Printf("%d payments (%d published twice), %d deliveries, %d acks lost, in %v\n",
		payments, (payments+4)/5, st.Received, lostAcks.Load(), time.Since(start).Round(time.Millisecond))
	fmt.Printf("duplicates absorbed: %d sequential (skipped), %d overlapping (retried later)\n", seq, overlap)
	fmt.Printf("ledger rows: %d (want %d); total balance: %d (want %d)\n", ledgerRows, payments, total, want)
	if ledgerRows != payments || total != want {
		return errors.New("a payment was applied twice or not at all")
	}
	fmt.Println("every payment applied exactly once")
	return nil
}

// duplicates reads the duplicate counter by kind.
func duplicates(ctx context.Context, r *sdkmetric.ManualReader) (sequential, overlapping int64) {
	var rm metricdata.ResourceMetrics
	if err := r.Collect(ctx, &rm); err != nil {
		return 0, 0
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			sum, ok := m.Data.(metricdata.Sum[int64])
			if m.Name != idempotency.MetricDuplicates || !ok {
				continue
			}
			for _, dp := range sum.DataPoints {
				switch v, _ := dp.Attributes.Value("custody.duplicate.kind"); v.AsString() {
				case "sequential":
					sequential += dp.Value
				case "overlapping":
					overlapping += dp.Value
				}
			}
		}
	}
	return sequential, overlapping
}

func setUp(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, `
DROP TABLE IF EXISTS example_ledger, example_accounts, example_processed;
CREATE TABLE example_accounts (id int PRIMARY KEY, balance bigint NOT NULL);
CREATE TABLE example_ledger (payment_id text NOT NULL, account int NOT NULL, amount bigint NOT NULL);
INSERT INTO example_accounts SELECT g, 0 FROM generate_series(0, `+strconv.Itoa(accounts-1)+`) g;`)
	return err
}

func deadLetters(b *memory.Broker) (*memory.DeadLetterQueue, error) {
	if err := b.CreateQueue("payments-dlq", memory.QueueOptions{}); err != nil {
		return nil, err
	}
	return b.DeadLetterQueue("payments-dlq")
}

// parsePayment reads "account:amount".
func parsePayment(body []byte) (account int, amount int64, err error) {
	a, b, ok := strings.Cut(string(body), ":")
	if !ok {
		return 0, 0, fmt.Errorf("payment %q is not account:amount", body)
	}
	if account, err = strconv.Atoi(a); err != nil {
		return 0, 0, fmt.Errorf("payment %q: account: %w", body, err)
	}
	if amount, err = strconv.ParseInt(b, 10, 64); err != nil {
		return 0, 0, fmt.Errorf("payment %q: amount: %w", body, err)
	}
	return account, amount, nil
}
