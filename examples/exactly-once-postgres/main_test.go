package main

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/custody-go/custody/internal/testkit/testbroker"
)

func TestExampleRuns(t *testing.T) {
	testbroker.Dial(t, "PostgreSQL", "127.0.0.1:5432")
	ctx := context.Background()
	if err := run(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn, err := pgx.Connect(ctx, "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
		if err == nil {
			_, _ = conn.Exec(ctx, "DROP TABLE IF EXISTS example_ledger, example_accounts, example_processed")
			conn.Close(ctx)
		}
	})
}
