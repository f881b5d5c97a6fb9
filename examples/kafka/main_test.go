package main

import (
	"context"
	"os"
	"testing"
	"time"
)

// The example runs against its embedded cluster: no broker needed.
func TestExampleRunsEmbedded(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := config{topic: "custody-example-orders", orders: 600, partitions: 8}
	if err := run(ctx, cfg, os.Stdout); err != nil {
		t.Fatal(err)
	}
}
