package main

import (
	"context"
	"crypto/rand"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/custody-go/custody/internal/testkit/testbroker"
)

func TestExampleRuns(t *testing.T) {
	url := testbroker.Addr("NATS_URL", "nats://127.0.0.1:4222")
	testbroker.Dial(t, "NATS JetStream", strings.TrimPrefix(url, "nats://"))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := config{url: url, stream: "custody_example_test_" + rand.Text()[:8], orders: 120}
	if err := run(ctx, cfg, os.Stdout); err != nil {
		t.Fatal(err)
	}
}
