package awssqs

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/adaptertest"
)

func TestConformanceStandard(t *testing.T) {
	t.Parallel()
	adaptertest.Run(t, adaptertest.Harness{NewQueue: func(t *testing.T, cfg adaptertest.QueueConfig) *adaptertest.Queue {
		if cfg.Ordered {
			t.Skip("standard SQS queues do not promise order; TestConformanceFIFO covers it")
		}
		return newConformanceQueue(t, cfg, false)
	}})
}

func TestConformanceFIFO(t *testing.T) {
	t.Parallel()
	adaptertest.Run(t, adaptertest.Harness{NewQueue: func(t *testing.T, cfg adaptertest.QueueConfig) *adaptertest.Queue {
		return newConformanceQueue(t, cfg, true)
	}})
}

// newConformanceQueue creates a queue and a dead-letter queue beside it,
// with the DeadLetter sink. On a FIFO queue a message without a key
// gets a group of its own, so unkeyed messages stay independent.
func newConformanceQueue(t *testing.T, cfg adaptertest.QueueConfig, fifo bool) *adaptertest.Queue {
	e := newEnv(t)
	lease := max(time.Second, cfg.Lease.Round(time.Second))
	url, _ := e.queue(fifo, lease, nil)
	dlqURL, _ := e.queue(fifo, 30*time.Second, nil)
	dlq, err := NewDeadLetter(e.ctx(), e.client, dlqURL)
	if err != nil {
		t.Fatal(err)
	}
	var (
		seq     atomic.Int64
		clients sync.Map // *Source -> *harnessClient
	)
	return &adaptertest.Queue{
		Lease: lease,
		Publish: func(ctx context.Context, msgs ...adaptertest.Message) error {
			for _, m := range msgs {
				group := ""
				if fifo {
					group = m.Key
					if group == "" {
						group = "g" + strconv.FormatInt(seq.Add(1), 10)
					}
				}
				e.sendAttributes(url, string(m.Body), group, packHeaders(m.Headers))
			}
			return nil
		},
		Open: func(t *testing.T) adapters.Source {
			c := &harnessClient{Client: e.client}
			src, err := New(e.ctx(), c, url, testOptions()...)
			if err != nil {
				t.Fatal(err)
			}
			clients.Store(src, c)
			return src
		},
		Crash:      func(src adapters.Source) { harnessClientOf(t, &clients, src).cut.Store(true) },
		Refuse:     func(src adapters.Source) { harnessClientOf(t, &clients, src).refuse.Store(true) },
		DeadLetter: dlq,
		DeadLettered: func(ctx context.Context) ([]adaptertest.Message, error) {
			out, err := e.client.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{
				QueueUrl: aws.String(dlqURL), MaxNumberOfMessages: 10, MessageAttributeNames: []string{"All"},
			})
			if err != nil {
				return nil, err
			}
			var ms []adaptertest.Message
			for _, m := range out.Messages {
				msg, err := readCopy(m)
				if err != nil {
					return nil, err
				}
				ms = append(ms, msg)
				// Consumed: on a FIFO queue the copies share a group, and
				// one left in flight would hold back the next.
				if _, err := e.client.DeleteMessage(ctx, &sqs.DeleteMessageInput{QueueUrl: aws.String(dlqURL), ReceiptHandle: m.ReceiptHandle}); err != nil {
					return nil, err
				}
			}
			return ms, nil
		},
	}
}

// harnessClient is the client of one Source the conformance harness opened.
// It passes calls on to the emulator, and can cut the Source off from it, as
// the death of the Source's process would (Queue.Crash), or answer for SQS
// that it could not delete the first entry of the next DeleteMessageBatch,
// as SQS does when it fails on its side (Queue.Refuse).
type harnessClient struct {
	Client
	cut    atomic.Bool
	refuse atomic.Bool
}

var errCut = errors.New("cut off from SQS by the conformance harness")

func harnessClientOf(t *testing.T, clients *sync.Map, src adapters.Source) *harnessClient {
	c, ok := clients.Load(src)
	if !ok {
		t.Fatalf("%T was not opened by this harness", src)
	}
	return c.(*harnessClient)
}

func (c *harnessClient) ReceiveMessage(ctx context.Context, in *sqs.ReceiveMessageInput, optFns ...func(*sqs.Options)) (*sqs.ReceiveMessageOutput, error) {
	if c.cut.Load() {
		return nil, errCut
	}
	return c.Client.ReceiveMessage(ctx, in, optFns...)
}

func (c *harnessClient) ChangeMessageVisibilityBatch(ctx context.Context, in *sqs.ChangeMessageVisibilityBatchInput, optFns ...func(*sqs.Options)) (*sqs.ChangeMessageVisibilityBatchOutput, error) {
	if c.cut.Load() {
		return nil, errCut
	}
	return c.Client.ChangeMessageVisibilityBatch(ctx, in, optFns...)
}

func (c *harnessClient) DeleteMessageBatch(ctx context.Context, in *sqs.DeleteMessageBatchInput, optFns ...func(*sqs.Options)) (*sqs.DeleteMessageBatchOutput, error) {
	if c.cut.Load() {
		return nil, errCut
	}
	if len(in.Entries) == 0 || !c.refuse.CompareAndSwap(true, false) {
		return c.Client.DeleteMessageBatch(ctx, in, optFns...)
	}
	out := &sqs.DeleteMessageBatchOutput{}
	if len(in.Entries) > 1 {
		rest := *in
		rest.Entries = in.Entries[1:]
		var err error
		if out, err = c.Client.DeleteMessageBatch(ctx, &rest, optFns...); err != nil {
			return nil, err
		}
	}
	out.Failed = append(out.Failed, types.BatchResultErrorEntry{
		Id:          in.Entries[0].Id,
		Code:        aws.String("InternalError"),
		Message:     aws.String("refused by the conformance harness, as SQS does when it fails on its side"),
		SenderFault: false,
	})
	return out, nil
}

// readCopy reads a DeadLetter copy as a user who knows its documented
// conventions would: the diagnostics JSON gives the diagnostic headers,
// "custody-original-attribute.NAME" keys in it are the original's header
// NAME (one SQS would refuse, or past its ten attributes), and
// "custody-body-encoding" says how to decode the body.
func readCopy(m types.Message) (adaptertest.Message, error) {
	h := map[string]string{}
	for k, v := range m.MessageAttributes {
		if k != DefaultDiagnosticsAttribute {
			h[k] = attributeString(v)
		}
	}
	diag, err := DecodeDiagnostics(m.MessageAttributes, DefaultDiagnosticsAttribute)
	if err != nil {
		return adaptertest.Message{}, err
	}
	body := []byte(aws.ToString(m.Body))
	for k, v := range diag {
		switch name, packed := strings.CutPrefix(k, "custody-original-attribute."); {
		case packed:
			h[name] = v
		case k == "custody-body-encoding":
			switch v {
			case "empty":
				body = nil
			case "base64":
				if body, err = base64.StdEncoding.DecodeString(string(body)); err != nil {
					return adaptertest.Message{}, fmt.Errorf("copy body marked base64: %w", err)
				}
			default:
				return adaptertest.Message{}, fmt.Errorf("copy body in unknown encoding %q", v)
			}
		default:
			h[k] = v
		}
	}
	return adaptertest.Message{Body: body, Headers: h}, nil
}

// packHeaders returns headers as SQS message attributes the way a
// DeadLetter copy carries them, so that publishing a message that holds
// an earlier dead-letter trip's diagnostics looks like replaying a real copy:
// the diagnostic headers inside one JSON attribute (custody-diagnostics), the
// others as String attributes, those past the ninth inside the JSON as
// "custody-original-attribute.NAME".
func packHeaders(headers map[string]string) map[string]types.MessageAttributeValue {
	if len(headers) == 0 {
		return nil
	}
	attrs := map[string]types.MessageAttributeValue{}
	diag := map[string]string{}
	names := make([]string, 0, len(headers))
	for k := range headers {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		v := headers[k]
		switch {
		case adapters.IsDiagnosticHeader(k):
			diag[k] = v
		case len(attrs) < maxAttributes-1:
			attrs[k] = types.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(v)}
		default:
			diag["custody-original-attribute."+k] = v
		}
	}
	if len(diag) > 0 {
		js, err := json.Marshal(diag)
		if err != nil {
			panic(err)
		}
		attrs[DefaultDiagnosticsAttribute] = types.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(string(js))}
	}
	return attrs
}
