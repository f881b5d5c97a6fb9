package awssqs

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/internal/testkit/sqsemu"
)

// patience bounds waits for things that should happen; tests poll rather
// than assume a speed.
const patience = 60 * time.Second

// env is one test's view of the emulator: a client whose requests are
// counted.
type env struct {
	t       testing.TB
	client  *sqs.Client
	counter *sqsemu.Counter
}

func newEnv(t testing.TB) *env {
	t.Helper()
	endpoint := sqsemu.Start(t)
	counter := &sqsemu.Counter{}
	return &env{t: t, client: sqsemu.NewClient(endpoint, counter), counter: counter}
}

func (e *env) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	e.t.Cleanup(cancel)
	return ctx
}

// queue creates a queue with a unique name (suffix ".fifo" added for FIFO
// queues) and returns its URL and ARN.
func (e *env) queue(fifo bool, visibility time.Duration, attrs map[string]string) (url, arn string) {
	e.t.Helper()
	name := sqsemu.QueueName(e.t)
	a := map[string]string{"VisibilityTimeout": strconv.Itoa(int(visibility / time.Second))}
	if fifo {
		name += ".fifo"
		a["FifoQueue"] = "true"
		a["ContentBasedDeduplication"] = "true"
	}
	for k, v := range attrs {
		a[k] = v
	}
	out, err := e.client.CreateQueue(e.ctx(), &sqs.CreateQueueInput{QueueName: aws.String(name), Attributes: a})
	if err != nil {
		e.t.Fatalf("CreateQueue %s: %v", name, err)
	}
	at, err := e.client.GetQueueAttributes(e.ctx(), &sqs.GetQueueAttributesInput{QueueUrl: out.QueueUrl, AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameQueueArn}})
	if err != nil {
		e.t.Fatalf("GetQueueAttributes %s: %v", name, err)
	}
	e.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		e.client.DeleteQueue(ctx, &sqs.DeleteQueueInput{QueueUrl: out.QueueUrl})
	})
	return *out.QueueUrl, at.Attributes[string(types.QueueAttributeNameQueueArn)]
}

func redrivePolicyJSON(dlqARN string, maxReceive int) string {
	return fmt.Sprintf(`{"deadLetterTargetArn":%q,"maxReceiveCount":"%d"}`, dlqARN, maxReceive)
}

// send publishes one message; group is used on FIFO queues.
func (e *env) send(url, body, group string, headers map[string]string) {
	e.t.Helper()
	var attrs map[string]types.MessageAttributeValue
	if len(headers) > 0 {
		attrs = map[string]types.MessageAttributeValue{}
		for k, v := range headers {
			attrs[k] = types.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(v)}
		}
	}
	e.sendAttributes(url, body, group, attrs)
}

// sendAttributes publishes one message with the given message attributes;
// group is used on FIFO queues.
func (e *env) sendAttributes(url, body, group string, attrs map[string]types.MessageAttributeValue) {
	e.t.Helper()
	in := &sqs.SendMessageInput{QueueUrl: aws.String(url), MessageBody: aws.String(body), MessageAttributes: attrs}
	if group != "" {
		in.MessageGroupId = aws.String(group)
	}
	if _, err := e.client.SendMessage(e.ctx(), in); err != nil {
		e.t.Fatalf("SendMessage: %v", err)
	}
}

// counts returns the queue's visible and in-flight message counts.
func (e *env) counts(url string) (visible, inFlight int) {
	e.t.Helper()
	out, err := e.client.GetQueueAttributes(e.ctx(), &sqs.GetQueueAttributesInput{QueueUrl: aws.String(url), AttributeNames: []types.QueueAttributeName{"All"}})
	if err != nil {
		e.t.Fatalf("GetQueueAttributes: %v", err)
	}
	visible, _ = strconv.Atoi(out.Attributes["ApproximateNumberOfMessages"])
	inFlight, _ = strconv.Atoi(out.Attributes["ApproximateNumberOfMessagesNotVisible"])
	return visible, inFlight
}

// stored returns how many messages url holds, visible, in flight or not yet
// visible. The emulator counts exactly, and has stored a message by the time
// SendMessage returns; it holds it back as delayed until its next turn even
// with no delay, which ApproximateNumberOfMessages leaves out, as it leaves
// out those in flight.
func (e *env) stored(url string) int {
	e.t.Helper()
	out, err := e.client.GetQueueAttributes(e.ctx(), &sqs.GetQueueAttributesInput{QueueUrl: aws.String(url), AttributeNames: []types.QueueAttributeName{"All"}})
	if err != nil {
		e.t.Fatalf("GetQueueAttributes: %v", err)
	}
	n := 0
	for _, a := range []string{"ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible", "ApproximateNumberOfMessagesDelayed"} {
		c, err := strconv.Atoi(out.Attributes[a])
		if err != nil {
			e.t.Fatalf("GetQueueAttributes: %s = %q", a, out.Attributes[a])
		}
		n += c
	}
	return n
}

// drain receives (and deletes) everything that becomes visible on url
// within d (at least one receive), and returns the messages.
func (e *env) drain(url string, d time.Duration) []types.Message {
	e.t.Helper()
	var got []types.Message
	deadline := time.Now().Add(d)
	for first := true; first || time.Now().Before(deadline); first = false {
		out, err := e.client.ReceiveMessage(e.ctx(), &sqs.ReceiveMessageInput{
			QueueUrl: aws.String(url), MaxNumberOfMessages: 10,
			AttributeNames:        []types.QueueAttributeName{"All"},
			MessageAttributeNames: []string{"All"},
		})
		if err != nil {
			e.t.Fatalf("ReceiveMessage: %v", err)
		}
		for _, m := range out.Messages {
			got = append(got, m)
			e.client.DeleteMessage(e.ctx(), &sqs.DeleteMessageInput{QueueUrl: aws.String(url), ReceiptHandle: m.ReceiptHandle})
		}
		if len(out.Messages) == 0 && d > 0 {
			time.Sleep(100 * time.Millisecond)
		}
	}
	return got
}

// testOptions suit the emulator: it answers a long poll only when the poll
// is full or its wait is over (and may return a message twice in one poll
// once the visibility timeout passes during the wait), so tests use short
// polls with a brief pause after an empty one.
func testOptions(extra ...Option) []Option {
	return append([]Option{WithWaitTime(0), withEmptyPollPause(50 * time.Millisecond)}, extra...)
}

func withEmptyPollPause(d time.Duration) Option {
	return func(o *options) error { o.emptyPollBackoff = d; return nil }
}

func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(patience)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", patience, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
