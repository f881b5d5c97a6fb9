package main

import (
	"context"
	"io"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/custody-go/custody/internal/testkit/testbroker"
)

// TestExampleRuns runs the program as `go run ./examples/bulk-postgres`
// does; it fails when a reading is stored twice or not at all.
func TestExampleRuns(t *testing.T) {
	testbroker.Dial(t, "PostgreSQL", "127.0.0.1:5432")
	ctx := context.Background()
	t.Cleanup(func() {
		conn, err := pgx.Connect(ctx, "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
		if err == nil {
			_, _ = conn.Exec(ctx, "DROP TABLE IF EXISTS example_bulk_single, example_bulk_batch, example_bulk_processed_single, example_bulk_processed_batch")
			conn.Close(ctx)
		}
	})
	if err := run(ctx, io.Discard); err != nil {
		t.Fatal(err)
	}
}
