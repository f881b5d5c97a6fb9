package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/awssqs"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/sqsemu"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

func TestMain(m *testing.M) { os.Exit(sqsemu.Run(m)) }

func runWith(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cfg, err := parseFlags(args, time.Now())
	if err != nil {
		t.Fatalf("flags %q: %v", args, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out strings.Builder
	err = run(ctx, cfg, &out)
	t.Log("\n" + out.String())
	return out.String(), err
}

// `go run ./examples/replay -broker memory` runs the whole demo: the dead
// letters listed by error, replayed, and handled once each.
func TestMemoryDemo(t *testing.T) {
	out, err := runWith(t, "-broker", "memory")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"dead-lettered 5",
		"3      3         ", // the outage's group, all selected
		"payment service unavailable",
		"invalid order: negative amount",
		"replayed 5, skipped 0",
		"handled orders [3 5 7 10 11], each once; 0 dead letters left",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("the demo's output lacks %q", want)
		}
	}
}

// The selection flags pick what goes back; the rest stays.
func TestMemoryDemoSelection(t *testing.T) {
	out, err := runWith(t, "-broker", "memory", "-error", "unavailable", "-max", "2", "-keep-diagnostics")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"replayed 2, skipped 2", "each once; 3 dead letters left"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	out, err = runWith(t, "-broker", "memory", "-list")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out, "replayed") || strings.Contains(out, "after the replay") {
		t.Errorf("-list alone replayed:\n%s", out)
	}
}

func TestFlagsRefuseBadInput(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-broker", "nats"}, "-broker"},
		{[]string{"-broker", "sqs"}, "-list"},
		{[]string{"-since", "yesterday"}, "-since"},
		{[]string{"-rate", "0"}, "-rate"},
		{[]string{"-max", "-1"}, "-max"},
		{[]string{"-list-max", "0"}, "-list-max"},
		{[]string{"extra"}, "unexpected"},
		{[]string{"-broker", "sqs", "-list", "-through-exchange"}, "-through-exchange"},
		{[]string{"-url", "amqp://elsewhere/"}, "-url"},
		{[]string{"-broker", "sqs", "-list", "-dlt", "orders.dlq"}, "-dlt"},
		{[]string{"-group", "replay"}, "-group"},
		{[]string{"-broker", "kafka", "-list", "-dlq", "orders.dlq"}, "-dlq"},
	} {
		if _, err := parseFlags(c.args, time.Now()); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("flags %q: %v, want an error naming %s", c.args, err, c.want)
		}
	}
	now := time.Date(2026, 12, 6, 10, 0, 0, 0, time.UTC)
	cfg, err := parseFlags([]string{"-since", "2h", "-error", "x", "-consumer", "orders"}, now)
	if err != nil {
		t.Fatal(err)
	}
	sel := cfg.selector()
	rec := adapters.DeadLetterRecord{Error: "a x b", Consumer: "orders", LastFailure: now.Add(-time.Hour)}
	if !sel(rec) {
		t.Error("the selection refused a matching dead letter")
	}
	for _, r := range []adapters.DeadLetterRecord{
		{Error: "a b", Consumer: "orders", LastFailure: now},
		{Error: "x", Consumer: "billing", LastFailure: now},
		{Error: "x", Consumer: "orders", LastFailure: now.Add(-3 * time.Hour)},
	} {
		if sel(r) {
			t.Errorf("the selection took %+v", r)
		}
	}
	if err := run(context.Background(), config{broker: "memory", dlq: "somewhere", list: true}, &strings.Builder{}); err == nil {
		t.Error("the memory demo accepted a -dlq")
	}
	for _, cfg := range []config{
		{broker: "kafka", brokers: "127.0.0.1:1", group: "g", list: true},
		{broker: "kafka", brokers: "127.0.0.1:1", dlt: "orders.dlq", list: true},
	} {
		if err := run(context.Background(), cfg, &strings.Builder{}); err == nil || !strings.Contains(err.Error(), map[bool]string{true: "-dlt", false: "-group"}[cfg.dlt == ""]) {
			t.Errorf("-broker kafka with %+v: %v; want the missing flag named", cfg, err)
		}
	}
}

// The SQS mode against the emulator, configured the way a user points the
// program at one: AWS_ENDPOINT_URL_SQS and the default configuration.
func TestSQS(t *testing.T) {
	endpoint := sqsemu.Start(t)
	t.Setenv("AWS_ENDPOINT_URL_SQS", endpoint)
	t.Setenv("AWS_REGION", "us-east-1")
	t.Setenv("AWS_ACCESS_KEY_ID", "fake")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "fake")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	client := sqsemu.NewClient(endpoint, nil)
	queue := func() string {
		out, err := client.CreateQueue(ctx, &sqs.CreateQueueInput{QueueName: aws.String(sqsemu.QueueName(t)), Attributes: map[string]string{"VisibilityTimeout": "30"}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { client.DeleteQueue(context.Background(), &sqs.DeleteQueueInput{QueueUrl: out.QueueUrl}) })
		return aws.ToString(out.QueueUrl)
	}
	url, dlqURL := queue(), queue()
	count := func(u string) int {
		a, err := client.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{QueueUrl: aws.String(u), AttributeNames: []types.QueueAttributeName{"All"}})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, k := range []string{"ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible", "ApproximateNumberOfMessagesDelayed"} {
			c, _ := strconv.Atoi(a.Attributes[k])
			n += c
		}
		return n
	}

	// Five dead letters: three of an outage, two of a bug.
	for i := range 5 {
		if _, err := client.SendMessage(ctx, &sqs.SendMessageInput{QueueUrl: aws.String(url), MessageBody: aws.String(fmt.Sprint(i))}); err != nil {
			t.Fatal(err)
		}
	}
	src, err := awssqs.New(ctx, client, url, awssqs.WithWaitTime(0))
	if err != nil {
		t.Fatal(err)
	}
	dlq, err := awssqs.NewDeadLetter(ctx, client, dlqURL)
	if err != nil {
		t.Fatal(err)
	}
	deadLetterOrders(t, ctx, src, dlq, func() bool { return count(dlqURL) >= 5 && count(url) == 0 })
	// The emulator goes on serving the stopped consumer's last poll for a
	// moment; let it end before copies arrive.
	time.Sleep(250 * time.Millisecond)

	out, err := runWith(t, "-broker", "sqs", "-dlq", dlqURL, "-list", "-wait", "0s", "-error", "unavailable")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"5 dead letters in SQS queue", "3      3 ", "2      0 ", "orders", "payment service unavailable"} {
		if !strings.Contains(out, want) {
			t.Errorf("-list output lacks %q", want)
		}
	}
	if n := count(url); n != 0 {
		t.Fatalf("-list moved %d messages", n)
	}

	out, err = runWith(t, "-broker", "sqs", "-dlq", dlqURL, "-replay", "-wait", "0s", "-hold", "5s", "-error", "unavailable", "-rate", "50")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "replayed 3, skipped 2") {
		t.Errorf("-replay output lacks the counts")
	}
	if n, m := count(url), count(dlqURL); n != 3 || m != 2 {
		t.Errorf("after the replay the queue holds %d and the dead-letter queue %d; want 3 and 2", n, m)
	}
	got, err := client.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{QueueUrl: aws.String(url), MaxNumberOfMessages: 10, MessageAttributeNames: []string{"All"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range got.Messages {
		if b := aws.ToString(m.Body); b >= "3" || m.MessageAttributes[adapters.HeaderReplayOf].StringValue == nil {
			t.Errorf("replayed %q with attributes %v", b, m.MessageAttributes)
		}
	}
}

// deadLetterOrders runs a consumer over src that fails every order
// permanently (those below "3" for an unavailable payment service, the rest
// as invalid), so that each goes to dl, until arrived reports the dead
// letters are in; then it stops the consumer.
func deadLetterOrders(t *testing.T, ctx context.Context, src adapters.Source, dl adapters.DeadLetter, arrived func() bool) {
	t.Helper()
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) < "3" {
			return consumer.Permanent(errors.New("payment service unavailable"))
		}
		return consumer.Permanent(errors.New("invalid order"))
	}), consumer.WithName("orders"), consumer.WithDeadLetter(dl), consumer.WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	ran := make(chan error, 1)
	go func() { ran <- c.Run(runCtx) }()
	for !arrived() {
		if ctx.Err() != nil {
			t.Fatal("the dead letters never arrived")
		}
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	if err := <-ran; err != nil {
		t.Fatal(err)
	}
}
