package awssqs

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testlog"
)

// failing is a handler that fails the message whose body is poison (with
// err) and handles the rest, counting calls per body.
type failing struct {
	poison string
	err    error
	mu     sync.Mutex
	calls  map[string]int
}

func (f *failing) Handle(ctx context.Context, m *consumer.Message) error {
	f.mu.Lock()
	if f.calls == nil {
		f.calls = map[string]int{}
	}
	f.calls[string(m.Body)]++
	f.mu.Unlock()
	if string(m.Body) == f.poison {
		return f.err
	}
	return nil
}

func (f *failing) count(body string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[body]
}

// runUntil runs a consumer until cond holds, then stops it.
func runUntil(t *testing.T, src adapters.Source, h consumer.Handler, what string, cond func() bool, opts ...consumer.Option) {
	t.Helper()
	opts = append([]consumer.Option{consumer.WithLogger(testlog.New(t))}, opts...)
	c, err := consumer.New(src, h, opts...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- c.Run(ctx) }()
	deadline := time.Now().Add(patience)
	for !cond() {
		if time.Now().After(deadline) {
			cancel()
			<-ran
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if err := <-ran; err != nil {
		t.Fatalf("Run: %v", err)
	}
}

func fastRetry(n int) consumer.Option {
	return consumer.WithRetry(consumer.Retry{MaxAttempts: n, Backoff: consumer.ConstantBackoff(10 * time.Millisecond)})
}

func TestDeadLetterQueueSink(t *testing.T) {
	t.Parallel()
	for _, fifo := range []bool{false, true} {
		t.Run(map[bool]string{false: "standard", true: "fifo"}[fifo], func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			url, _ := e.queue(fifo, 5*time.Second, nil)
			dlqURL, _ := e.queue(fifo, 30*time.Second, nil)
			group := ""
			if fifo {
				group = "orders-7"
			}
			// Ten attributes: the copy must still fit SQS's limit of ten.
			headers := map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
			for i := range 9 {
				headers[fmt.Sprintf("a%d", i)] = fmt.Sprint(i)
			}
			e.send(url, "poison body", group, headers)
			e.send(url, "good body", group+"x", nil)

			src, err := New(e.ctx(), e.client, url, testOptions()...)
			if err != nil {
				t.Fatal(err)
			}
			dlq, err := NewDeadLetterQueue(e.client, dlqURL)
			if err != nil {
				t.Fatal(err)
			}
			h := &failing{poison: "poison body", err: errors.New("cannot parse order 7")}
			var got []types.Message
			before := time.Now()
			runUntil(t, src, h, "the poison message in the dead-letter queue", func() bool {
				got = append(got, e.drain(dlqURL, 0)...)
				return len(got) > 0 && h.count("good body") == 1
			}, fastRetry(3), consumer.WithDeadLetter(dlq))

			if len(got) != 1 {
				t.Fatalf("dead-letter queue holds %d messages, want 1", len(got))
			}
			m := got[0]
			if aws.ToString(m.Body) != "poison body" {
				t.Errorf("dead-letter body %q, want the original", aws.ToString(m.Body))
			}
			if n := h.count("poison body"); n != 3 {
				t.Errorf("poison message handled %d times, want MaxAttempts=3", n)
			}
			if len(m.MessageAttributes) > 10 {
				t.Errorf("dead-letter copy has %d attributes, SQS allows 10", len(m.MessageAttributes))
			}
			diag, err := DecodeDiagnostics(m.MessageAttributes, DefaultDiagnosticsAttribute)
			if err != nil {
				t.Fatal(err)
			}
			want := map[string]string{
				adapters.HeaderAttempts:      "3",
				adapters.HeaderPermanent:     "false",
				adapters.HeaderOriginalQueue: src.name,
			}
			for k, v := range want {
				if diag[k] != v {
					t.Errorf("diagnostic %s = %q, want %q (all: %v)", k, diag[k], v, diag)
				}
			}
			if !strings.Contains(diag[adapters.HeaderError], "cannot parse order 7") {
				t.Errorf("diagnostic error %q lacks the handler's error", diag[adapters.HeaderError])
			}
			for _, k := range []string{adapters.HeaderFirstFailure, adapters.HeaderLastFailure} {
				ts, err := time.Parse(time.RFC3339Nano, diag[k])
				if err != nil || ts.Before(before.Add(-time.Second)) || ts.After(time.Now()) {
					t.Errorf("diagnostic %s = %q, want a time during the test", k, diag[k])
				}
			}
			// Every original attribute survives, as an attribute or, past
			// the limit, inside the diagnostics.
			for k, v := range headers {
				if a, ok := m.MessageAttributes[k]; ok {
					if aws.ToString(a.StringValue) != v {
						t.Errorf("attribute %s = %q, want %q", k, aws.ToString(a.StringValue), v)
					}
				} else if diag[diagAttrPrefix+k] != v {
					t.Errorf("original attribute %s lost from the dead-letter copy", k)
				}
			}
			if fifo {
				if g := m.Attributes["MessageGroupId"]; g != group {
					t.Errorf("dead-letter copy in group %q, want the original's %q", g, group)
				}
				if diag[diagGroupID] != group || diag[diagDedupID] == "" {
					t.Errorf("FIFO ids missing from diagnostics: %v", diag)
				}
			}
			// The original is gone from its queue: deleted after the send.
			waitFor(t, "the source queue to empty", func() bool { v, f := e.counts(url); return v+f == 0 })
		})
	}
}

// A poison message from another broker (here the memory broker), with a
// binary body and headers SQS would refuse as attributes, reaches the SQS
// dead-letter queue whole: the body base64-encoded, the refused headers in
// the diagnostics.
func TestDeadLetterQueueTakesAnotherBrokersDelivery(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dlqURL, _ := e.queue(false, 30*time.Second, nil)
	dlq, err := NewDeadLetterQueue(e.client, dlqURL)
	if err != nil {
		t.Fatal(err)
	}
	b := memory.NewBroker()
	if err := b.CreateQueue("orders", memory.QueueOptions{Lease: time.Minute}); err != nil {
		t.Fatal(err)
	}
	body := []byte{0x00, 0xff, 0xfe, 'b', 'i', 'n', 0x01}
	headers := map[string]string{
		"content-type":    "application/x-protobuf", // kept as an attribute
		"x retry reason!": "spaces and ! are refused in names",
		"AWS.trace":       "reserved prefix",
		"empty":           "",
		"control-char":    "a\x00b",
	}
	if err := b.Publish(e.ctx(), "orders", memory.Message{Body: body, Headers: headers}); err != nil {
		t.Fatal(err)
	}
	src, err := b.Source("orders")
	if err != nil {
		t.Fatal(err)
	}
	var got []types.Message
	runUntil(t, src, consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		return consumer.Permanent(errors.New("unknown schema"))
	}), "the copy in the SQS dead-letter queue", func() bool {
		got = append(got, e.drain(dlqURL, 0)...)
		return len(got) > 0
	}, consumer.WithDeadLetter(dlq))
	if st, _ := b.Stats("orders"); st.Acked != 1 {
		t.Fatalf("original not acked after the copy was stored: %+v", st)
	}
	m := got[0]
	diag, err := DecodeDiagnostics(m.MessageAttributes, DefaultDiagnosticsAttribute)
	if err != nil {
		t.Fatal(err)
	}
	if diag[diagBodyEncoding] != "base64" {
		t.Fatalf("%s = %q, want base64 for a binary body", diagBodyEncoding, diag[diagBodyEncoding])
	}
	decoded, err := base64.StdEncoding.DecodeString(aws.ToString(m.Body))
	if err != nil || !bytes.Equal(decoded, body) {
		t.Fatalf("copy body %q decodes to %q (%v), want %q", aws.ToString(m.Body), decoded, err, body)
	}
	if v := aws.ToString(m.MessageAttributes["content-type"].StringValue); v != headers["content-type"] {
		t.Errorf("attribute content-type = %q, want %q", v, headers["content-type"])
	}
	for _, k := range []string{"x retry reason!", "AWS.trace", "empty", "control-char"} {
		if _, ok := m.MessageAttributes[k]; ok {
			t.Errorf("header %q sent as an attribute; SQS refuses it", k)
		}
		if v, ok := diag[diagAttrPrefix+k]; !ok || v != headers[k] {
			t.Errorf("header %q = %q in the diagnostics (present %v), want %q", k, v, ok, headers[k])
		}
	}
}

func TestDeadLetterQueueSendFailureKeepsOriginal(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 5*time.Second, nil)
	e.send(url, "poison body", "", nil)
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	// A dead-letter queue URL that does not exist: SQS refuses the send.
	dlq, err := NewDeadLetterQueue(e.client, strings.TrimSuffix(url, src.name)+"no-such-queue")
	if err != nil {
		t.Fatal(err)
	}
	h := &failing{poison: "poison body", err: consumer.Permanent(errors.New("bad"))}
	runUntil(t, src, h, "a few attempts", func() bool { return h.count("poison body") >= 1 },
		fastRetry(1), consumer.WithDeadLetter(dlq), consumer.WithShutdownTimeout(5*time.Second))
	// The original must still be in its queue: nacked for the retry, or
	// released at shutdown, it becomes visible again.
	waitFor(t, "the original back in its queue", func() bool {
		got := e.drain(url, 0)
		return len(got) == 1 && aws.ToString(got[0].Body) == "poison body"
	})
}

func TestNativeRedrive(t *testing.T) {
	t.Parallel()
	for _, permanent := range []bool{false, true} {
		t.Run(map[bool]string{false: "retries", true: "permanent"}[permanent], func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			dlqURL, dlqARN := e.queue(false, 30*time.Second, nil)
			url, arn := e.queue(false, 5*time.Second, map[string]string{"RedrivePolicy": redrivePolicyJSON(dlqARN, 3)})
			e.send(url, "poison body", "", map[string]string{"origin": "test"})
			e.send(url, "good body", "", nil)
			src, err := New(e.ctx(), e.client, url, testOptions()...)
			if err != nil {
				t.Fatal(err)
			}
			redrive, err := src.Redrive(3)
			if err != nil {
				t.Fatal(err)
			}
			var cause error = errors.New("cannot parse")
			if permanent {
				cause = consumer.Permanent(cause)
			}
			h := &failing{poison: "poison body", err: cause}
			var got []types.Message
			runUntil(t, src, h, "the poison message in the dead-letter queue", func() bool {
				got = append(got, e.drain(dlqURL, 0)...)
				return len(got) > 0 && h.count("good body") == 1
			}, fastRetry(3), consumer.WithDeadLetter(redrive))
			if len(got) != 1 || aws.ToString(got[0].Body) != "poison body" {
				t.Fatalf("dead-letter queue holds %v, want the poison message", got)
			}
			m := got[0]
			if aws.ToString(m.MessageAttributes["origin"].StringValue) != "test" {
				t.Errorf("original attribute lost: %v", m.MessageAttributes)
			}
			// SQS's own diagnostics in native mode: where it came from.
			if src := m.Attributes["DeadLetterQueueSourceArn"]; src != arn {
				t.Errorf("DeadLetterQueueSourceArn = %q, want %q", src, arn)
			}
			want := 3
			if permanent {
				want = 1 // later receives are released without running the handler
			}
			if n := h.count("poison body"); n != want {
				t.Errorf("poison message handled %d times, want %d", n, want)
			}
			if redrive.HandedOver() < 1 {
				t.Errorf("Redrive.HandedOver() = %d", redrive.HandedOver())
			}
			waitFor(t, "the source queue to empty", func() bool { v, f := e.counts(url); return v+f == 0 })
		})
	}
}

func TestRedriveChecksMaxReceiveCount(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	_, dlqARN := e.queue(false, 30*time.Second, nil)
	url, _ := e.queue(false, 5*time.Second, map[string]string{"RedrivePolicy": redrivePolicyJSON(dlqARN, 4)})
	plain, _ := e.queue(false, 5*time.Second, nil)
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if _, err := src.Redrive(5); !errors.Is(err, ErrRedriveMismatch) || !strings.Contains(err.Error(), "maxReceiveCount=4") || !strings.Contains(err.Error(), "MaxAttempts=5") {
		t.Errorf("Redrive(5) on maxReceiveCount 4: %v, want ErrRedriveMismatch naming both", err)
	}
	if r, err := src.Redrive(5, AllowRedriveMismatch(testlog.New(t))); err != nil || r.MaxReceiveCount() != 4 {
		t.Errorf("Redrive(5, AllowRedriveMismatch): %v, %v", r, err)
	}
	if _, err := src.Redrive(4); err != nil {
		t.Errorf("Redrive(4) on maxReceiveCount 4: %v", err)
	}
	src2, err := New(e.ctx(), e.client, plain, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src2.Close()
	if _, err := src2.Redrive(3); err == nil || !strings.Contains(err.Error(), "no RedrivePolicy") {
		t.Errorf("Redrive on a queue without a policy: %v", err)
	}
}
