// Command bulk-postgres stores meter readings from a queue in PostgreSQL
// exactly once, twice over: one transaction per message (pgtx.New), then
// one transaction and one multi-row INSERT per batch of 100 (pgtx.NewBatch),
// and prints the throughput of each.
//
// It uses the embedded memory broker, so PostgreSQL is all it needs; without
// DATABASE_URL it connects to postgres://postgres@127.0.0.1:5432/test:
//
//	go run ./examples/bulk-postgres
//	DATABASE_URL=postgres://user@host:5432/db go run ./examples/bulk-postgres
//
// Each run gets the same queue: every reading once, a tenth of them twice (a
// producer that retried), one that cannot be parsed, and one ack in twenty
// lost, so that some readings come back after they were stored. In both
// runs the readings and the records that they were processed commit in one
// transaction, and the runtime acks only after that commit: every reading
// is stored once, the unparseable one is dead-lettered, and the table has
// no row twice. The batch run commits once per batch instead of once per
// message, which is where its throughput comes from.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
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

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency/pgtx"
)

const (
	readings  = 5000
	batchSize = 100
	handlers  = 4 // in each run: transactions at once, as many as pgxpool's default connections on a small machine
)

func main() {
	if err := run(context.Background(), os.Stdout); err != nil {
		log.Fatal(err)
	}
}

// result is what one run did.
type result struct {
	took         time.Duration
	rows         int
	deliveries   int64
	lostAcks     int64
	deadLettered int // distinct readings: a lost ack can dead-letter one twice
}

func (r result) perSecond() float64 { return float64(readings) / r.took.Seconds() }

func run(ctx context.Context, out io.Writer) error {
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

	// One message, one transaction: the reading's row and its key.
	single, err := pgtx.New(pool, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		r, err := parseReading(m.Body)
		if err != nil {
			return consumer.Permanent(err) // unparseable: dead-letter it, do not retry
		}
		_, err = tx.Exec(ctx, `INSERT INTO example_bulk_single (reading_id, meter, kwh) VALUES ($1, $2, $3)`, m.ID, r.meter, r.kwh)
		return err
	}, pgtx.WithTable("example_bulk_processed_single"))
	if err != nil {
		return err
	}
	if err := single.CreateSchema(ctx); err != nil {
		return err
	}

	// One batch, one transaction: the rows of all its new readings in one
	// INSERT, with all their keys. A reading that cannot be parsed is
	// failed before anything is written for it: its key is taken out of
	// the transaction and it goes to the dead-letter queue alone.
	bulk, err := pgtx.NewBatch(pool, func(ctx context.Context, tx pgx.Tx, b *consumer.Batch) error {
		var ids, meters []string
		var kwhs []float64
		for _, m := range b.Messages {
			r, err := parseReading(m.Body)
			if err != nil {
				b.Fail(m, consumer.Permanent(err))
				continue
			}
			ids, meters, kwhs = append(ids, m.ID), append(meters, r.meter), append(kwhs, r.kwh)
		}
		_, err := tx.Exec(ctx, `INSERT INTO example_bulk_batch (reading_id, meter, kwh)
SELECT * FROM unnest($1::text[], $2::text[], $3::float8[])`, ids, meters, kwhs)
		return err // nil commits: every reading not failed above is stored
	}, pgtx.WithTable("example_bulk_processed_batch"))
	if err != nil {
		return err
	}
	if err := bulk.CreateSchema(ctx); err != nil {
		return err
	}

	perMessage, err := consume(ctx, pool, "example_bulk_single", func(src adapters.Source, opts []consumer.Option) (*consumer.Consumer, error) {
		return consumer.New(src, single, append(opts, consumer.WithConcurrency(handlers))...)
	})
	if err != nil {
		return fmt.Errorf("per-message run: %w", err)
	}
	batched, err := consume(ctx, pool, "example_bulk_batch", func(src adapters.Source, opts []consumer.Option) (*consumer.Consumer, error) {
		return consumer.NewBatch(src, bulk, append(opts, consumer.WithConcurrency(handlers), consumer.WithBatchSize(batchSize))...)
	})
	if err != nil {
		return fmt.Errorf("batch run: %w", err)
	}

	fmt.Fprintf(out, "%d readings (%d published twice, 1 unparseable), one ack in 20 lost\n", readings, readings/10)
	for _, r := range []struct {
		name string
		res  result
	}{{fmt.Sprintf("per message (pgtx.New, %d handlers)", handlers), perMessage}, {fmt.Sprintf("batches of %d (pgtx.NewBatch, %d handlers)", batchSize, handlers), batched}} {
		fmt.Fprintf(out, "%-45s %6.0f readings/s  (%v; %d deliveries, %d acks lost; %d rows, %d dead-lettered)\n",
			r.name, r.res.perSecond(), r.res.took.Round(time.Millisecond), r.res.deliveries, r.res.lostAcks, r.res.rows, r.res.deadLettered)
	}
	fmt.Fprintf(out, "batches: %.1fx the per-message throughput\n", batched.perSecond()/perMessage.perSecond())
	for _, r := range []result{perMessage, batched} {
		if r.rows != readings-1 || r.deadLettered != 1 {
			return errors.New("a reading was stored twice or not at all")
		}
	}
	fmt.Fprintln(out, "every reading stored exactly once in both runs")
	return nil
}

// consume publishes the readings to a fresh queue, consumes them with the
// consumer newConsumer makes until the queue is empty, and reports what
// happened and how long it took.
func consume(ctx context.Context, pool *pgxpool.Pool, table string, newConsumer func(adapters.Source, []consumer.Option) (*consumer.Consumer, error)) (result, error) {
	const queue = "readings"
	broker := memory.NewBroker()
	for _, q := range []string{queue, "dead-letters"} {
		if err := broker.CreateQueue(q, memory.QueueOptions{Lease: time.Second}); err != nil {
			return result{}, err
		}
	}
	for i := range readings {
		body := fmt.Appendf(nil, "meter-%d:%d.%d", i%50, i%17, i%10)
		if i == readings/2+1 {
			body = []byte("meter-7:not a number")
		}
		m := memory.Message{ID: "reading-" + strconv.Itoa(i), Body: body}
		copies := 1
		if i%10 == 0 {
			copies = 2
		}
		for range copies {
			if err := broker.Publish(ctx, queue, m); err != nil {
				return result{}, err
			}
		}
	}
	var lost atomic.Int64
	src, err := broker.Source(queue, memory.WithFaults(memory.Faults{Ack: func(*adapters.Delivery) error {
		if rand.N(20) == 0 {
			lost.Add(1)
			return errors.New("ack lost on the way to the broker")
		}
		return nil
	}}))
	if err != nil {
		return result{}, err
	}
	dlq, err := broker.DeadLetterQueue("dead-letters")
	if err != nil {
		return result{}, err
	}
	c, err := newConsumer(src, []consumer.Option{
		consumer.WithDeadLetter(dlq),
		consumer.WithLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))),
	})
	if err != nil {
		return result{}, err
	}

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- c.Run(runCtx) }()
	// The throughput counts until every reading is stored; the
	// redeliveries of the messages whose ack was lost come after their
	// lease, and are skipped.
	for stored := 0; stored < readings-1; {
		time.Sleep(10 * time.Millisecond)
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&stored); err != nil {
			return result{}, err
		}
	}
	took := time.Since(start)
	if err := broker.WaitEmpty(ctx, queue); err != nil {
		return result{}, err
	}
	stop()
	if err := <-done; err != nil {
		return result{}, err
	}

	r := result{took: took, lostAcks: lost.Load()}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&r.rows); err != nil {
		return result{}, err
	}
	st, err := broker.Stats(queue)
	if err != nil {
		return result{}, err
	}
	r.deliveries = st.Received
	dl, err := broker.Messages("dead-letters")
	if err != nil {
		return result{}, err
	}
	ids := map[string]bool{}
	for _, m := range dl {
		ids[m.Headers[adapters.HeaderOriginalID]] = true
	}
	r.deadLettered = len(ids)
	return r, nil
}

func setUp(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, `
DROP TABLE IF EXISTS example_bulk_single, example_bulk_batch, example_bulk_processed_single, example_bulk_processed_batch;
CREATE TABLE example_bulk_single (reading_id text NOT NULL, meter text NOT NULL, kwh float8 NOT NULL);
CREATE TABLE example_bulk_batch (reading_id text NOT NULL, meter text NOT NULL, kwh float8 NOT NULL);`)
	return err
}

type reading struct {
	meter string
	kwh   float64
}

// parseReading reads "meter:kwh".
func parseReading(body []byte) (reading, error) {
	meter, kwh, ok := strings.Cut(string(body), ":")
	if !ok {
		return reading{}, fmt.Errorf("reading %q is not meter:kwh", body)
	}
	v, err := strconv.ParseFloat(kwh, 64)
	if err != nil {
		return reading{}, fmt.Errorf("reading %q: kWh: %w", body, err)
	}
	return reading{meter: meter, kwh: v}, nil
}
