package pgstore_test

import (
	"context"
	"log"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/pgstore"
)

// The idempotency middleware with its records in PostgreSQL, shared by
// every consumer of the database. The table comes first (here from the
// program; a migration can apply pgstore.DDL() instead): New checks that
// it is there.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := pgstore.CreateSchema(ctx, pool); err != nil {
		log.Fatal(err)
	}
	store, err := pgstore.New(ctx, pool)
	if err != nil {
		log.Fatal(err) // PostgreSQL does not answer, or the table is missing
	}
	dedup, err := idempotency.New(store)
	if err != nil {
		log.Fatal(err)
	}
	var handler consumer.Handler // performs the effect
	_ = consumer.Chain(handler, dedup)
}
