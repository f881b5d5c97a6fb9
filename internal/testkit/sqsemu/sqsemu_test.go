package sqsemu

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/internal/testkit/testbroker"
)

func TestMain(m *testing.M) { os.Exit(Run(m)) }

func TestStartServesSQSAndCounts(t *testing.T) {
	endpoint := Start(t)
	if again := Start(t); again != endpoint {
		t.Errorf("second Start returned %s, want the shared %s", again, endpoint)
	}
	counter := &Counter{}
	c := NewClient(endpoint, counter)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	q, err := c.CreateQueue(ctx, &sqs.CreateQueueInput{QueueName: aws.String(QueueName(t))})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.SendMessage(ctx, &sqs.SendMessageInput{QueueUrl: q.QueueUrl, MessageBody: aws.String("hi")}); err != nil {
		t.Fatal(err)
	}
	if counter.Total() != 2 || counter.Op("CreateQueue") != 1 || counter.Op("SendMessage") != 1 {
		t.Errorf("counted %d requests (CreateQueue %d, SendMessage %d), want 1 each", counter.Total(), counter.Op("CreateQueue"), counter.Op("SendMessage"))
	}
	counter.Reset()
	if counter.Total() != 0 || counter.Op("SendMessage") != 0 {
		t.Error("Reset left counts behind")
	}
}

// The emulator is patched at start-up so a visibility change is not counted
// as a receive; this checks the patch is in force.
func TestVisibilityChangeIsNotAReceive(t *testing.T) {
	c := NewClient(Start(t), nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	q, err := c.CreateQueue(ctx, &sqs.CreateQueueInput{QueueName: aws.String(QueueName(t))})
	if err != nil {
		t.Fatal(err)
	}
	c.SendMessage(ctx, &sqs.SendMessageInput{QueueUrl: q.QueueUrl, MessageBody: aws.String("hi")})
	for want := 1; want <= 3; want++ {
		out, err := c.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{QueueUrl: q.QueueUrl, AttributeNames: []types.QueueAttributeName{"ApproximateReceiveCount"}})
		if err != nil || len(out.Messages) != 1 {
			t.Fatalf("receive %d: %v, %d messages", want, err, len(out.Messages))
		}
		if got := out.Messages[0].Attributes["ApproximateReceiveCount"]; got != strconv.Itoa(want) {
			t.Fatalf("receive %d reports ApproximateReceiveCount %s", want, got)
		}
		// Renew twice, then release: none of these is a receive.
		for _, v := range []int32{30, 30, 0} {
			if _, err := c.ChangeMessageVisibility(ctx, &sqs.ChangeMessageVisibilityInput{QueueUrl: q.QueueUrl, ReceiptHandle: out.Messages[0].ReceiptHandle, VisibilityTimeout: v}); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// The emulator is patched at start-up so that ApproximateNumberOfMessages
// counts the messages available for retrieval only, as SQS does, and not
// those in flight, which ApproximateNumberOfMessagesNotVisible counts.
func TestInFlightMessagesAreNotCountedAsAvailable(t *testing.T) {
	c := NewClient(Start(t), nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	q, err := c.CreateQueue(ctx, &sqs.CreateQueueInput{QueueName: aws.String(QueueName(t))})
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := c.SendMessage(ctx, &sqs.SendMessageInput{QueueUrl: q.QueueUrl, MessageBody: aws.String("hi")}); err != nil {
			t.Fatal(err)
		}
	}
	out, err := c.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{QueueUrl: q.QueueUrl, MaxNumberOfMessages: 1, VisibilityTimeout: 60})
	if err != nil || len(out.Messages) != 1 {
		t.Fatalf("receive: %v, %d messages", err, len(out.Messages))
	}
	a, err := c.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{QueueUrl: q.QueueUrl, AttributeNames: []types.QueueAttributeName{"All"}})
	if err != nil {
		t.Fatal(err)
	}
	if v, nv := a.Attributes["ApproximateNumberOfMessages"], a.Attributes["ApproximateNumberOfMessagesNotVisible"]; v != "2" || nv != "1" {
		t.Fatalf("ApproximateNumberOfMessages %s, ApproximateNumberOfMessagesNotVisible %s; want 2 available and 1 in flight", v, nv)
	}
}

func TestQueueNameIsValidAndUnique(t *testing.T) {
	a, b := QueueName(t), QueueName(t)
	if a == b || len(a) > 80 || strings.ContainsAny(a, "/ .") {
		t.Errorf("QueueName gave %q and %q", a, b)
	}
}

// TestInstallFromLockFile runs the npm ci path a fresh clone takes, into a
// scratch copy of this directory.
func TestInstallFromLockFile(t *testing.T) {
	if testing.Short() {
		t.Skip("downloads from the npm registry")
	}
	if _, err := exec.LookPath("npm"); err != nil {
		testbroker.Unavailable(t, "npm", err)
	}
	dir, err := findDir()
	if err != nil {
		t.Fatal(err)
	}
	scratch := t.TempDir()
	for _, name := range []string{"package.json", "package-lock.json"} {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(scratch, name), b, 0o644)
	}
	ctx, cancel := context.WithTimeout(context.Background(), installTimeout)
	defer cancel()
	if err := ensureInstalled(ctx, scratch); err != nil {
		testbroker.Unavailable(t, "the npm registry", err)
	}
	if _, err := os.Stat(filepath.Join(scratch, "node_modules", "local-aws-sqs", "package.json")); err != nil {
		t.Fatalf("npm ci did not install local-aws-sqs: %v", err)
	}
	matches, _ := filepath.Glob(filepath.Join(scratch, ".npm-ci-*"))
	if len(matches) != 0 {
		t.Errorf("scratch install directories left behind: %v", matches)
	}
}
