package awssqs

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/sqsemu"
	"github.com/custody-go/custody/internal/testkit/testlog"
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

func TestDeadLetterSink(t *testing.T) {
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
			dlq, err := NewDeadLetter(e.ctx(), e.client, dlqURL)
			if err != nil {
				t.Fatal(err)
			}
			if dlq.FIFO() != fifo {
				t.Errorf("DeadLetter.FIFO() = %v for a queue created with FifoQueue=%v", dlq.FIFO(), fifo)
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
func TestDeadLetterTakesAnotherBrokersDelivery(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dlqURL, _ := e.queue(false, 30*time.Second, nil)
	dlq, err := NewDeadLetter(e.ctx(), e.client, dlqURL)
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

func TestDeadLetterSendFailureKeepsOriginal(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 5*time.Second, nil)
	e.send(url, "poison body", "", nil)
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	// A dead-letter queue deleted after the sink was made: SQS refuses the
	// send.
	dlqURL, _ := e.queue(false, 30*time.Second, nil)
	dlq, err := NewDeadLetter(e.ctx(), e.client, dlqURL)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.DeleteQueue(e.ctx(), &sqs.DeleteQueueInput{QueueUrl: aws.String(dlqURL)}); err != nil {
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

// A wrong dead-letter queue URL (or region, endpoint, credentials) fails
// NewDeadLetter, saying what to check, instead of the first poison
// message's Send, which would fail on every attempt.
func TestNewDeadLetterChecksTheQueue(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 5*time.Second, nil)
	wrong := url + "-dlq" // never created
	_, err := NewDeadLetter(e.ctx(), e.client, wrong)
	if err == nil {
		t.Fatalf("NewDeadLetter(%s) succeeded for a queue that does not exist", wrong)
	}
	for _, want := range []string{wrong, "does not exist", "region", "create the queue"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}

	// Nothing answers at the endpoint: the error says what to check.
	dead := sqsemu.NewClient("http://127.0.0.1:1", nil)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	_, err = NewDeadLetter(ctx, dead, url)
	if err == nil {
		t.Fatal("NewDeadLetter succeeded with no SQS at the client's endpoint")
	}
	for _, want := range []string{url, "endpoint", "credentials", "sqs:SendMessage"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}

	// A cancelled context ends the check.
	cancelled, cancelNow := context.WithCancel(context.Background())
	cancelNow()
	if _, err := NewDeadLetter(cancelled, e.client, url); !errors.Is(err, context.Canceled) {
		t.Errorf("NewDeadLetter with a cancelled context: %v, want context.Canceled", err)
	}
}

// The sink fits its copies to the dead-letter queue's own MaximumMessageSize:
// with SQS's refusal of a larger copy, the poison message would never leave
// its queue.
func TestDeadLetterFitsTheQueuesSizeLimit(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 5*time.Second, nil)
	dlqURL, _ := e.queue(false, 30*time.Second, map[string]string{"MaximumMessageSize": "2048"})
	if _, err := NewDeadLetter(e.ctx(), e.client, dlqURL, WithMaxMessageSize(4096)); err == nil || !strings.Contains(err.Error(), "WithMaxMessageSize") || !strings.Contains(err.Error(), "2048") {
		t.Errorf("WithMaxMessageSize(4096) on a queue taking 2048 bytes: %v, want an error naming the option and the queue's limit", err)
	}

	body := strings.Repeat("b", 1500)
	e.send(url, body, "", nil)
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	dlq, err := NewDeadLetter(e.ctx(), e.client, dlqURL)
	if err != nil {
		t.Fatal(err)
	}
	// With this error text the copy is over 2048 bytes until the text is
	// shortened.
	h := &failing{poison: body, err: consumer.Permanent(errors.New(strings.Repeat("e", 1000)))}
	var got []types.Message
	runUntil(t, src, h, "the poison message in the dead-letter queue", func() bool {
		got = append(got, e.drain(dlqURL, 0)...)
		return len(got) > 0
	}, fastRetry(1), consumer.WithDeadLetter(dlq))
	if len(got) != 1 || aws.ToString(got[0].Body) != body {
		t.Fatalf("dead-letter queue holds %d messages, want the poison message", len(got))
	}
	diag, err := DecodeDiagnostics(got[0].MessageAttributes, DefaultDiagnosticsAttribute)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(diag[adapters.HeaderError]); n >= 1000 || n < minErrorTextKept {
		t.Errorf("error text of %d bytes in the copy, want it shortened from 1000", n)
	}
}

// hidingDeadLetter wraps a dead-letter destination as user code might (to
// log its writes), hiding whether it settles the original itself
// (adapters.OriginalSettler): the runtime then acks the original after
// Send, which must not delete a message given back to the redrive policy.
type hidingDeadLetter struct{ adapters.DeadLetter }

func TestNativeRedrive(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name      string
		permanent bool
		wrapped   bool
	}{{"retries", false, false}, {"permanent", true, false}, {"wrapped sink", false, true}} {
		permanent := c.permanent
		t.Run(c.name, func(t *testing.T) {
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
			redrive, err := src.NativeDeadLetter(3)
			if err != nil {
				t.Fatal(err)
			}
			var cause error = errors.New("cannot parse")
			if permanent {
				cause = consumer.Permanent(cause)
			}
			h := &failing{poison: "poison body", err: cause}
			var sink adapters.DeadLetter = redrive
			if c.wrapped {
				sink = hidingDeadLetter{redrive}
			}
			var got []types.Message
			runUntil(t, src, h, "the poison message in the dead-letter queue", func() bool {
				got = append(got, e.drain(dlqURL, 0)...)
				return len(got) > 0 && h.count("good body") == 1
			}, fastRetry(3), consumer.WithDeadLetter(sink))
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
				t.Errorf("NativeDeadLetter.HandedOver() = %d", redrive.HandedOver())
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
	if _, err := src.NativeDeadLetter(5); !errors.Is(err, ErrRedriveMismatch) || !strings.Contains(err.Error(), "maxReceiveCount=4") || !strings.Contains(err.Error(), "MaxAttempts=5") {
		t.Errorf("NativeDeadLetter(5) on maxReceiveCount 4: %v, want ErrRedriveMismatch naming both", err)
	}
	if r, err := src.NativeDeadLetter(5, AllowRedriveMismatch(testlog.New(t))); err != nil || r.MaxReceiveCount() != 4 {
		t.Errorf("NativeDeadLetter(5, AllowRedriveMismatch): %v, %v", r, err)
	}
	if _, err := src.NativeDeadLetter(4); err != nil {
		t.Errorf("NativeDeadLetter(4) on maxReceiveCount 4: %v", err)
	}
	src2, err := New(e.ctx(), e.client, plain, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src2.Close()
	if _, err := src2.NativeDeadLetter(3); err == nil || !strings.Contains(err.Error(), "no RedrivePolicy") {
		t.Errorf("NativeDeadLetter on a queue without a policy: %v", err)
	}
}

// Two deliveries from another broker that look alike (an AMQP message-id is
// the publisher's choice and repeats when a message is replayed; here every
// field but the receive time is the same) must both reach a FIFO dead-letter
// queue. SQS drops a message whose deduplication id it saw in the last five
// minutes while reporting it sent, and the runtime then acks the original:
// the second message would be lost. A Send retried for one delivery must
// still store one copy.
func TestDeadLetterFIFOKeepsLookAlikeDeliveries(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dlqURL, _ := e.queue(true, 30*time.Second, nil)
	dlq, err := NewDeadLetter(e.ctx(), e.client, dlqURL)
	if err != nil {
		t.Fatal(err)
	}
	received := time.Now()
	delivery := func(at time.Time) *adapters.Delivery {
		return &adapters.Delivery{ID: "order-7", Body: []byte("same body"), Headers: map[string]string{"h": "v"},
			Queue: "amqp/orders", Partition: -1, Offset: -1, Attempt: 1, ReceivedAt: at}
	}
	first, replayed := delivery(received), delivery(received.Add(time.Minute))
	fail := adapters.Failure{Err: errors.New("bad order"), Attempts: 1, Permanent: true}
	for _, d := range []*adapters.Delivery{first, first, replayed} { // first twice: a retried Send
		if err := dlq.Send(e.ctx(), d, fail); err != nil {
			t.Fatalf("Send: %v", err)
		}
	}
	switch n := e.stored(dlqURL); {
	case n < 2:
		t.Fatalf("FIFO dead-letter queue holds %d copies of two deliveries it accepted: SQS dropped a copy as a duplicate, and the runtime deletes its original", n)
	case n > 2:
		t.Fatalf("FIFO dead-letter queue holds %d copies of two deliveries: a retried Send stored a second copy", n)
	}
}

// TestDeadLetterFIFOGroupsForeignCopiesByLane: copies of another
// broker's messages in a FIFO dead-letter queue are grouped by their lane
// (a Kafka partition or key), so the order the source kept is kept and
// lanes do not wait on each other; a lane SQS would refuse as a group id
// (characters it does not allow, or over 128 of them) is hashed; a message
// without a lane gets a group of its own. (In one group for all, one stuck
// copy would hold every other behind it.)
func TestDeadLetterFIFOGroupsForeignCopiesByLane(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dlqURL, _ := e.queue(true, 30*time.Second, nil)
	dlq, err := NewDeadLetter(e.ctx(), e.client, dlqURL)
	if err != nil {
		t.Fatal(err)
	}
	record := func(lane, body string) *adapters.Delivery {
		return &adapters.Delivery{ID: "orders/0/" + body, Body: []byte(body), OrderingKey: lane,
			Queue: "orders", Partition: 0, Offset: 1, Attempt: 1, ReceivedAt: time.Now()}
	}
	badLane := "orders/0/clé client " + strings.Repeat("k", 130)
	// Plain ASCII, but 129 characters: one more than SQS allows.
	longLane := "orders/0/" + strings.Repeat("k", 120)
	sent := map[string]string{ // body: its lane
		"a1": "orders/0", "a2": "orders/0", "b1": badLane, "c1": longLane, "u1": "", "u2": "",
	}
	fail := adapters.Failure{Err: errors.New("bad record"), Attempts: 1, Permanent: true}
	for _, body := range []string{"a1", "a2", "b1", "c1", "u1", "u2"} {
		if err := dlq.Send(e.ctx(), record(sent[body], body), fail); err != nil {
			t.Fatalf("Send %s: %v", body, err)
		}
	}
	groups := map[string]string{}
	for deadline := time.Now().Add(patience); len(groups) < len(sent) && time.Now().Before(deadline); {
		for _, m := range e.drain(dlqURL, 0) {
			groups[aws.ToString(m.Body)] = m.Attributes[string(types.MessageSystemAttributeNameMessageGroupId)]
		}
	}
	if len(groups) != len(sent) {
		t.Fatalf("the dead-letter queue holds %v, want copies of %v", groups, sent)
	}
	if groups["a1"] != "orders/0" || groups["a2"] != "orders/0" {
		t.Errorf("copies of lane orders/0 in groups %q and %q, want orders/0", groups["a1"], groups["a2"])
	}
	for _, body := range []string{"b1", "c1"} {
		if g := groups[body]; !strings.HasPrefix(g, "custody-lane-") {
			t.Errorf("copy %s of a lane SQS refuses as a group id is in group %q, want a digest of its lane", body, g)
		}
	}
	if groups["b1"] == groups["c1"] {
		t.Errorf("copies of two lanes share the group %q", groups["b1"])
	}
	if groups["u1"] == groups["u2"] || groups["u1"] == "orders/0" {
		t.Errorf("copies without a lane share group %q / %q; want a group each", groups["u1"], groups["u2"])
	}
}

// SQS messages get a new receipt handle at every receive: a message
// received again (after a lost lease, say) and dead-lettered again is stored
// again, while a Send retried for one receive is stored once.
func TestDeadLetterFIFOCopiesPerReceive(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(true, 30*time.Second, nil)
	dlqURL, _ := e.queue(true, 30*time.Second, nil)
	e.send(url, "poison", "g", nil)
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dlq, err := NewDeadLetter(e.ctx(), e.client, dlqURL)
	if err != nil {
		t.Fatal(err)
	}
	receive := func() *adapters.Delivery {
		t.Helper()
		for {
			ds, err := src.Receive(e.ctx(), 1)
			if err != nil {
				t.Fatalf("Receive: %v", err)
			}
			if len(ds) == 1 {
				return ds[0]
			}
		}
	}
	fail := adapters.Failure{Err: errors.New("bad"), Attempts: 1, Permanent: true}
	d1 := receive()
	for range 2 {
		if err := dlq.Send(e.ctx(), d1, fail); err != nil {
			t.Fatalf("Send: %v", err)
		}
	}
	if err := src.Nack(e.ctx(), adapters.NackAll([]*adapters.Delivery{d1}, 0)); err != nil {
		t.Fatalf("Nack: %v", err)
	}
	d2 := receive()
	if err := dlq.Send(e.ctx(), d2, fail); err != nil {
		t.Fatalf("Send: %v", err)
	}
	switch n := e.stored(dlqURL); {
	case n < 2:
		t.Fatalf("FIFO dead-letter queue holds %d copies after a message was received and dead-lettered twice: SQS dropped a copy as a duplicate, and the runtime deletes its original", n)
	case n > 2:
		t.Fatalf("FIFO dead-letter queue holds %d copies after two receives: a retried Send stored a second copy", n)
	}
}

// A message replayed from a dead-letter queue into its source (SQS's
// StartMessageMoveTask moves it unchanged) and dead-lettered again: the new
// copy describes the new failure only. The old diagnostics JSON goes, and so
// do plain attributes named like diagnostic headers (another broker's
// dead-letter destination writes them as headers); what the old JSON held of
// the message itself (attributes that did not fit, the body's encoding)
// stays.
func TestDeadLetterReplayedCopy(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 5*time.Second, nil)
	dlqURL, _ := e.queue(false, 30*time.Second, nil)
	old, err := json.Marshal(map[string]string{
		adapters.HeaderError:                "stale error",
		adapters.HeaderOriginalQueue:        "stale-queue",
		adapters.HeaderOriginalPart:         "7777",
		diagGroupID:                         "stale-group",
		"custody-original-attribute.big":    "carried",
		"custody-original-attribute.origin": "stale origin", // the message has it again
		"custody-body-encoding":             "base64",
	})
	if err != nil {
		t.Fatal(err)
	}
	body := base64.StdEncoding.EncodeToString([]byte{0, 0xff, 'x'})
	str := func(v string) types.MessageAttributeValue {
		return types.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(v)}
	}
	e.sendAttributes(url, body, "", map[string]types.MessageAttributeValue{
		DefaultDiagnosticsAttribute:   str(string(old)),
		adapters.HeaderOriginalOffset: str("7777"),
		adapters.HeaderConsumer:       str("stale-consumer"),
		"origin":                      str("test"),
	})
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	dlq, err := NewDeadLetter(e.ctx(), e.client, dlqURL)
	if err != nil {
		t.Fatal(err)
	}
	var got []types.Message
	runUntil(t, src, consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		return consumer.Permanent(errors.New("fresh failure"))
	}), "the copy in the dead-letter queue", func() bool {
		got = append(got, e.drain(dlqURL, 0)...)
		return len(got) > 0
	}, consumer.WithDeadLetter(dlq), consumer.WithName("fresh-consumer"))
	m := got[0]
	diag, err := DecodeDiagnostics(m.MessageAttributes, DefaultDiagnosticsAttribute)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{adapters.HeaderOriginalOffset, adapters.HeaderConsumer} {
		if a, ok := m.MessageAttributes[k]; ok {
			t.Errorf("attribute %s = %q from the earlier trip survived beside the new diagnostics", k, attributeString(a))
		}
	}
	want := map[string]string{
		adapters.HeaderOriginalQueue:                   src.name,
		adapters.HeaderConsumer:                        "fresh-consumer",
		adapters.HeaderOriginalPart:                    "", // an SQS message has none
		adapters.HeaderOriginalOffset:                  "",
		diagGroupID:                                    "", // a standard queue has none
		diagAttrPrefix + "big":                         "carried",
		diagAttrPrefix + "origin":                      "",
		diagAttrPrefix + adapters.HeaderOriginalOffset: "",
		diagBodyEncoding:                               "base64",
	}
	for k, v := range want {
		if diag[k] != v {
			t.Errorf("diagnostic %s = %q, want %q (all: %v)", k, diag[k], v, diag)
		}
	}
	if e := diag[adapters.HeaderError]; !strings.Contains(e, "fresh failure") || strings.Contains(e, "stale") {
		t.Errorf("diagnostic %s = %q, want the new failure only", adapters.HeaderError, e)
	}
	if aws.ToString(m.Body) != body {
		t.Errorf("body %q, want the replayed copy's %q", aws.ToString(m.Body), body)
	}
	if v := attributeString(m.MessageAttributes["origin"]); v != "test" {
		t.Errorf("attribute origin = %q, want %q", v, "test")
	}
}

// A message from another broker that was dead-lettered there (its
// destination writes the diagnostics as headers) and replayed: none of the
// old headers reaches the SQS copy.
func TestDeadLetterDropsForeignStaleDiagnostics(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dlqURL, _ := e.queue(false, 30*time.Second, nil)
	dlq, err := NewDeadLetter(e.ctx(), e.client, dlqURL)
	if err != nil {
		t.Fatal(err)
	}
	d := &adapters.Delivery{ID: "m-1", Body: []byte("body"), Queue: "amqp/orders", Partition: -1, Offset: -1, ReceivedAt: time.Now(),
		Headers: map[string]string{
			adapters.HeaderOriginalPart:       "7777",
			adapters.HeaderOriginalExchange:   "stale-exchange",
			adapters.HeaderOriginalRoutingKey: "", // empty: SQS would refuse it as an attribute
			"kept":                            "yes",
		}}
	if err := dlq.Send(e.ctx(), d, adapters.Failure{Err: errors.New("fresh"), Attempts: 1}); err != nil {
		t.Fatal(err)
	}
	got := e.drain(dlqURL, 0)
	if len(got) != 1 {
		t.Fatalf("dead-letter queue holds %d messages, want 1", len(got))
	}
	m := got[0]
	diag, err := DecodeDiagnostics(m.MessageAttributes, DefaultDiagnosticsAttribute)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{adapters.HeaderOriginalPart, adapters.HeaderOriginalExchange, adapters.HeaderOriginalRoutingKey} {
		if a, ok := m.MessageAttributes[k]; ok {
			t.Errorf("stale header %s = %q became an attribute of the copy", k, attributeString(a))
		}
		if v, ok := diag[diagAttrPrefix+k]; ok {
			t.Errorf("stale header %s = %q travelled in the diagnostics", k, v)
		}
		if v, ok := diag[k]; ok {
			t.Errorf("diagnostic %s = %q, but this failure has none", k, v)
		}
	}
	if v := attributeString(m.MessageAttributes["kept"]); v != "yes" {
		t.Errorf("attribute kept = %q, want %q", v, "yes")
	}
}

// The X-Ray trace header SQS keeps beside a message (the AWSTraceHeader
// system attribute) reaches the handler and stays on the dead-letter copy.
func TestDeadLetterKeepsTraceHeader(t *testing.T) {
	t.Parallel()
	const trace = "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1"
	for _, tc := range []struct {
		name string
		fifo bool
		// systemNames: the emulator reads only the deprecated
		// AttributeNames; this client hands it MessageSystemAttributeNames
		// in their place, as SQS reads them now.
		systemNames bool
	}{{"standard", false, false}, {"fifo", true, false}, {"MessageSystemAttributeNames", false, true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			fifo := tc.fifo
			e := newEnv(t)
			url, _ := e.queue(fifo, 5*time.Second, nil)
			dlqURL, _ := e.queue(fifo, 30*time.Second, nil)
			var client Client = e.client
			if tc.systemNames {
				client = systemNamesClient{e.client}
			}
			in := &sqs.SendMessageInput{QueueUrl: aws.String(url), MessageBody: aws.String("traced"),
				MessageSystemAttributes: map[string]types.MessageSystemAttributeValue{
					"AWSTraceHeader": {DataType: aws.String("String"), StringValue: aws.String(trace)},
				}}
			if fifo {
				in.MessageGroupId = aws.String("g")
			}
			if _, err := e.client.SendMessage(e.ctx(), in); err != nil {
				t.Fatal(err)
			}
			src, err := New(e.ctx(), client, url, testOptions()...)
			if err != nil {
				t.Fatal(err)
			}
			dlq, err := NewDeadLetter(e.ctx(), e.client, dlqURL)
			if err != nil {
				t.Fatal(err)
			}
			var (
				mu   sync.Mutex
				seen string
				got  []types.Message
			)
			runUntil(t, src, consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
				msg, _ := Message(m)
				mu.Lock()
				seen = msg.Attributes["AWSTraceHeader"]
				mu.Unlock()
				return consumer.Permanent(errors.New("bad"))
			}), "the copy in the dead-letter queue", func() bool {
				got = append(got, e.drain(dlqURL, 0)...)
				return len(got) > 0
			}, consumer.WithDeadLetter(dlq))
			mu.Lock()
			defer mu.Unlock()
			if seen != trace {
				t.Errorf("handler saw AWSTraceHeader %q, want %q", seen, trace)
			}
			if v := got[0].Attributes["AWSTraceHeader"]; v != trace {
				t.Errorf("dead-letter copy has AWSTraceHeader %q, want the original's %q", v, trace)
			}
		})
	}
}

// systemNamesClient passes the Source's receives to the emulator with the
// system attribute names taken from MessageSystemAttributeNames alone (the
// emulator reads only AttributeNames, which SQS has deprecated).
type systemNamesClient struct{ *sqs.Client }

func (c systemNamesClient) ReceiveMessage(ctx context.Context, in *sqs.ReceiveMessageInput, o ...func(*sqs.Options)) (*sqs.ReceiveMessageOutput, error) {
	cp := *in
	cp.AttributeNames = nil
	for _, a := range in.MessageSystemAttributeNames {
		cp.AttributeNames = append(cp.AttributeNames, types.QueueAttributeName(a))
	}
	cp.MessageSystemAttributeNames = nil
	return c.Client.ReceiveMessage(ctx, &cp, o...)
}

// TestDiagnosticsAttributeNameSQSRefuses: SQS refuses a message attribute
// whose name has a leading, trailing or doubled '.', or a character other
// than a letter, a digit, '_', '-' or '.'. A DeadLetter whose
// diagnostics attribute is named so would have every copy refused, and no
// poison message would ever leave its queue; NewDeadLetter must refuse
// the name and say which option is at fault.
func TestDiagnosticsAttributeNameSQSRefuses(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	dlqURL, _ := e.queue(false, 30*time.Second, nil)
	e.send(url, "poison body", "", nil)
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ds := receiveAtLeast(t, src, 1)
	defer src.Nack(e.ctx(), adapters.NackAll(ds, 0))
	f := adapters.Failure{Err: errors.New("cannot parse"), Permanent: true, Attempts: 1}
	// The emulator checks the dots only; SQS refuses all of these.
	for _, name := range []string{".diagnostics", "diagnostics.", "custody..diagnostics", "custody diagnostics", "custody/diagnostics"} {
		q, err := NewDeadLetter(e.ctx(), e.client, dlqURL, WithDiagnosticsAttribute(name))
		if err == nil {
			t.Errorf("WithDiagnosticsAttribute(%q) was accepted; a Send then returns %v", name, q.Send(e.ctx(), ds[0], f))
			continue
		}
		if !strings.Contains(err.Error(), "WithDiagnosticsAttribute") {
			t.Errorf("WithDiagnosticsAttribute(%q): %v, want an error naming the option", name, err)
		}
	}
	// Names SQS takes are still accepted, and the copy goes through.
	for _, name := range []string{"custody.diagnostics", "Custody_diag-2"} {
		q, err := NewDeadLetter(e.ctx(), e.client, dlqURL, WithDiagnosticsAttribute(name))
		if err != nil {
			t.Fatalf("WithDiagnosticsAttribute(%q): %v", name, err)
		}
		if err := q.Send(e.ctx(), ds[0], f); err != nil {
			t.Errorf("Send with diagnostics attribute %q: %v", name, err)
		}
	}
}

// TestRedriveSendOfALostLeaseSucceeds: NativeDeadLetter.Send gives the message back
// to SQS for its redrive policy. When SQS refuses the release because the
// lease was lost (here the message was deleted meanwhile, as a consumer
// that received it after this one's lease ran out would), the message is
// already SQS's to move or gone: Send succeeds and settles the delivery
// rather than report a failed dead-letter write.
func TestRedriveSendOfALostLeaseSucceeds(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	_, dlqARN := e.queue(false, 30*time.Second, nil)
	url, _ := e.queue(false, 30*time.Second, map[string]string{"RedrivePolicy": redrivePolicyJSON(dlqARN, 3)})
	e.send(url, "poison body", "", nil)
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	redrive, err := src.NativeDeadLetter(3)
	if err != nil {
		t.Fatal(err)
	}
	d := receiveAtLeast(t, src, 1)[0]
	if _, err := e.client.DeleteMessage(e.ctx(), &sqs.DeleteMessageInput{QueueUrl: aws.String(url), ReceiptHandle: aws.String(receipt(d))}); err != nil {
		t.Fatal(err)
	}
	if err := redrive.Send(e.ctx(), d, adapters.Failure{Err: errors.New("cannot parse"), Attempts: 3}); err != nil {
		t.Fatalf("Send of a delivery whose lease was lost: %v, want nil", err)
	}
	if redrive.HandedOver() != 1 {
		t.Errorf("after Send: handed over %d; want 1", redrive.HandedOver())
	}
	if n := src.Stats().LeaseLost; n != 1 {
		t.Errorf("Stats.LeaseLost = %d; want the lost lease counted", n)
	}
}

// An ack after NativeDeadLetter.Send leaves the message for the redrive
// policy: the runtime sends one when a wrapper around the sink hides that
// the sink settles the original itself.
func TestAckAfterRedriveSendLeavesTheMessage(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	_, dlqARN := e.queue(false, 30*time.Second, nil)
	url, _ := e.queue(false, 30*time.Second, map[string]string{"RedrivePolicy": redrivePolicyJSON(dlqARN, 3)})
	e.send(url, "poison body", "", nil)
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	redrive, err := src.NativeDeadLetter(3)
	if err != nil {
		t.Fatal(err)
	}
	d := receiveAtLeast(t, src, 1)[0]
	if err := redrive.Send(e.ctx(), d, adapters.Failure{Err: errors.New("cannot parse"), Attempts: 3}); err != nil {
		t.Fatal(err)
	}
	if err := src.Ack(e.ctx(), []*adapters.Delivery{d}); err != nil {
		t.Fatalf("Ack after the redrive's Send: %v, want nil", err)
	}
	if v, f := e.counts(url); v+f != 1 {
		t.Fatalf("the queue holds %d messages after the ack, want the poison message still there for its redrive policy", v+f)
	}
}
