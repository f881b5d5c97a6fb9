package pgtx_test

import (
	"context"
	"encoding/json"
	"log"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency/pgtx"
)

// A payment written exactly once: the INSERT and the record that its
// message was processed commit in one transaction, and the message is acked
// only after the commit. A redelivered copy finds its key recorded and is
// acked without running the function again.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	h, err := pgtx.New(pool, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		var p struct {
			ID     string
			Amount int64
		}
		if err := json.Unmarshal(m.Body, &p); err != nil {
			return consumer.Permanent(err)
		}
		// Through tx, never the pool: only what tx writes is exactly once.
		_, err := tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ($1, $2)`, p.ID, p.Amount)
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
	// Creates the processed-keys table if missing; or apply h.DDL() with
	// your migrations.
	if err := h.CreateSchema(ctx); err != nil {
		log.Fatal(err)
	}

	// The broker's source and dead-letter destination, from an adapter
	// package: awssqs, rabbitmq or kafka.
	var src adapters.Source
	var dlq adapters.DeadLetter
	c, err := consumer.New(src, h, consumer.WithConcurrency(8), consumer.WithDeadLetter(dlq))
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
