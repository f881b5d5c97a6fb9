package main

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	awsconfig "github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/custody-go/custody/internal/testkit/sqsemu"
)

func TestMain(m *testing.M) { os.Exit(sqsemu.Run(m)) }

// TestExampleRuns runs the example against the emulator, configured the way
// a user would point it at one: AWS_ENDPOINT_URL_SQS and the default config.
func TestExampleRuns(t *testing.T) {
	endpoint := sqsemu.Start(t)
	t.Setenv("AWS_ENDPOINT_URL_SQS", endpoint)
	t.Setenv("AWS_REGION", "us-east-1")
	t.Setenv("AWS_ACCESS_KEY_ID", "fake")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "fake")
	for _, redrive := range []bool{false, true} {
		name := map[bool]string{false: "sink", true: "redrive"}[redrive]
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			awsCfg, err := awsconfig.LoadDefaultConfig(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var out strings.Builder
			cfg := config{queue: "custody-example-" + name, orders: 120, create: true, redrive: redrive, wait: time.Second}
			if err := run(ctx, sqs.NewFromConfig(awsCfg), cfg, &out); err != nil {
				t.Fatal(err)
			}
			t.Log("\n" + out.String())
			if !strings.Contains(out.String(), "dead-lettered") {
				t.Errorf("no dead-lettered order reported:\n%s", out.String())
			}
		})
	}
}
