package awssqs

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
)

func TestInvalidOptionsNameTheOption(t *testing.T) {
	cases := []struct {
		opt  Option
		name string
	}{
		{WithWaitTime(21 * time.Second), "WithWaitTime"},
		{WithWaitTime(1500 * time.Millisecond), "WithWaitTime"},
		{WithWaitTime(-time.Second), "WithWaitTime"},
		{WithMaxMessages(11), "WithMaxMessages"},
		{WithMaxMessages(0), "WithMaxMessages"},
		{WithPollers(0), "WithPollers"},
		{WithVisibilityTimeout(0), "WithVisibilityTimeout"},
		{WithVisibilityTimeout(13 * time.Hour), "WithVisibilityTimeout"},
		{WithVisibilityTimeout(1500 * time.Millisecond), "WithVisibilityTimeout"},
		{WithMessageAttributes(), "WithMessageAttributes"},
		{WithAckLinger(2 * time.Second), "WithAckLinger"},
		{WithAckLinger(-time.Millisecond), "WithAckLinger"},
		{WithNackLinger(-time.Second), "WithNackLinger"},
		{WithNackLinger(2 * time.Second), "WithNackLinger"},
		{WithMeterProvider(nil), "WithMeterProvider"},
	}
	for _, c := range cases {
		o := defaultOptions()
		err := c.opt(&o)
		if err == nil || !strings.Contains(err.Error(), c.name) {
			t.Errorf("%s: error %v, want one naming the option", c.name, err)
		}
	}
	// New reports the option error before touching the network.
	if _, err := New(context.Background(), noClient{}, "http://127.0.0.1:1/123/q", WithPollers(-1)); err == nil || !strings.Contains(err.Error(), "WithPollers") {
		t.Errorf("New with a bad option: %v", err)
	}
	if _, err := New(context.Background(), noClient{}, "not a url"); err == nil || !strings.Contains(err.Error(), "not a URL") {
		t.Errorf("New with a bad URL: %v", err)
	}
	if _, err := New(context.Background(), nil, "http://x/1/q"); err == nil {
		t.Error("New with a nil client succeeded")
	}
	if _, err := NewDeadLetter(context.Background(), nil, "http://x/1/q"); err == nil {
		t.Error("NewDeadLetter with a nil client succeeded")
	}
	// NewDeadLetter, too, reports the option error before touching the
	// network.
	for _, opt := range []DeadLetterOption{WithMaxMessageSize(10), WithMaxMessageSize(2 << 20), WithDiagnosticsAttribute("AWS.x")} {
		if _, err := NewDeadLetter(context.Background(), noSender{}, "http://x/1/q", opt); err == nil || !strings.Contains(err.Error(), "awssqs.With") {
			t.Errorf("NewDeadLetter with a bad option: %v", err)
		}
	}
}

// noClient and noSender satisfy the interfaces for tests that must fail
// before any call is made; every method says so.
type noClient struct{ Client }
type noSender struct{ Sender }

func TestParseRedrivePolicy(t *testing.T) {
	for _, s := range []string{
		`{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:1:dlq","maxReceiveCount":"5"}`,
		`{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:1:dlq","maxReceiveCount":5}`,
	} {
		p, err := parseRedrivePolicy(s)
		if err != nil || p.MaxReceiveCount != 5 || p.DeadLetterTargetArn != "arn:aws:sqs:us-east-1:1:dlq" {
			t.Errorf("parseRedrivePolicy(%s) = %+v, %v", s, p, err)
		}
	}
	for _, s := range []string{`{`, `{"maxReceiveCount":"0"}`, `{"maxReceiveCount":"x"}`} {
		if _, err := parseRedrivePolicy(s); err == nil {
			t.Errorf("parseRedrivePolicy(%s) succeeded", s)
		}
	}
}

func TestReceiptInvalidClassification(t *testing.T) {
	entry := func(code, msg string) types.BatchResultErrorEntry {
		return types.BatchResultErrorEntry{Code: aws.String(code), Message: aws.String(msg), SenderFault: true}
	}
	lost := []types.BatchResultErrorEntry{
		entry("ReceiptHandleIsInvalid", "The input receipt handle is invalid."),
		entry("AWS.SimpleQueueService.MessageNotInflight", "Message not inflight"),
		entry("InvalidParameterValue", "Value x for parameter ReceiptHandle is invalid. Reason: The receipt handle has expired."),
	}
	for _, e := range lost {
		if !receiptInvalid(e) {
			t.Errorf("%s not recognised as a lost lease", aws.ToString(e.Code))
		}
	}
	for _, e := range []types.BatchResultErrorEntry{
		entry("InvalidParameterValue", "Value 50000 for parameter VisibilityTimeout is invalid."),
		entry("InternalError", "oops"),
	} {
		if receiptInvalid(e) {
			t.Errorf("%s: %s taken for a lost lease", aws.ToString(e.Code), aws.ToString(e.Message))
		}
	}
}

func TestVisibilityCappedAtTwelveHours(t *testing.T) {
	now := time.Now()
	d := &adapters.Delivery{ReceivedAt: now.Add(-MaxLeaseAge + 90*time.Second)}
	secs, err := capTimeout(d, 5*time.Minute, now)
	if err != nil || secs != 90 {
		t.Errorf("renewal near the cap: %d s, %v; want 90 s", secs, err)
	}
	if secs, _ := capTimeout(&adapters.Delivery{ReceivedAt: now}, 1500*time.Millisecond, now); secs != 2 {
		t.Errorf("1.5 s rounds to %d s, want 2 (never shorter than asked)", secs)
	}
	old := &adapters.Delivery{ReceivedAt: now.Add(-MaxLeaseAge)}
	if _, err := capTimeout(old, time.Minute, now); !errors.Is(err, ErrMaxVisibility) || !errors.Is(err, adapters.ErrLeaseLost) {
		t.Errorf("renewal past 12 h: %v; want ErrMaxVisibility, a lost lease", err)
	}
	if secs, _ := capTimeout(&adapters.Delivery{ReceivedAt: now.Add(-MaxLeaseAge)}, time.Minute, now); secs != 0 {
		t.Errorf("a nack past 12 h asks %d s, want 0 (visible at once)", secs)
	}
}

func TestDeadLetterCopyFitsSizeLimit(t *testing.T) {
	q, err := newDeadLetter(noSender{}, "http://x/1/dlq", []DeadLetterOption{WithMaxMessageSize(2048)})
	if err != nil {
		t.Fatal(err)
	}
	d := &adapters.Delivery{ID: "m1", Body: []byte(strings.Repeat("b", 1500)), Queue: "q", Partition: -1, Offset: -1}
	in, err := q.message(d, adapters.Failure{Err: errors.New(strings.Repeat("e", 1000)), Attempts: 3})
	if err != nil {
		t.Fatalf("a copy that fits after shortening the error text: %v", err)
	}
	if n := messageSize(in); n > 2048 {
		t.Errorf("copy is %d bytes, over the 2048 limit", n)
	}
	diag, err := DecodeDiagnostics(in.MessageAttributes, DefaultDiagnosticsAttribute)
	if err != nil || !strings.HasPrefix(diag[adapters.HeaderError], "eee") || diag[adapters.HeaderAttempts] != "3" {
		t.Errorf("diagnostics after shortening: %v, %v", diag, err)
	}
	d.Body = []byte(strings.Repeat("b", 2100))
	if _, err := q.message(d, adapters.Failure{Err: errors.New("x")}); err == nil || !strings.Contains(err.Error(), "WithMaxMessageSize") {
		t.Errorf("a copy that cannot fit: %v, want an error saying what to do", err)
	}
}
