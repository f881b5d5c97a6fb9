package main

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/custody-go/custody/internal/testkit/testbroker"
)

func TestExampleRuns(t *testing.T) {
	addr := testbroker.Addr("CUSTODY_RABBITMQ_ADDR", "127.0.0.1:5672")
	testbroker.Dial(t, "RabbitMQ", addr)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := config{url: "amqp://guest:guest@" + addr + "/", queue: "custody-example-test-orders", orders: 120}
	if err := run(ctx, cfg, os.Stdout); err != nil {
		t.Fatal(err)
	}
}
