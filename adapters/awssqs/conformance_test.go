package awssqs

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

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
// with the DeadLetterQueue sink. On a FIFO queue a message without a key
// gets a group of its own, so unkeyed messages stay independent.
func newConformanceQueue(t *testing.T, cfg adaptertest.QueueConfig, fifo bool) *adaptertest.Queue {
	e := newEnv(t)
	lease := max(time.Second, cfg.Lease.Round(time.Second))
	url, _ := e.queue(fifo, lease, nil)
	dlqURL, _ := e.queue(fifo, 30*time.Second, nil)
	dlq, err := NewDeadLetterQueue(e.client, dlqURL)
	if err != nil {
		t.Fatal(err)
	}
	var seq atomic.Int64
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
				e.send(url, string(m.Body), group, m.Headers)
			}
			return nil
		},
		Open: func(t *testing.T) adapters.Source {
			src, err := New(e.ctx(), e.client, url, testOptions()...)
			if err != nil {
				t.Fatal(err)
			}
			return src
		},
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
				h := map[string]string{}
				for k, v := range m.MessageAttributes {
					h[k] = attributeString(v)
				}
				diag, err := DecodeDiagnostics(m.MessageAttributes, DefaultDiagnosticsAttribute)
				if err != nil {
					return nil, err
				}
				for k, v := range diag {
					h[k] = v
				}
				ms = append(ms, adaptertest.Message{Body: []byte(aws.ToString(m.Body)), Headers: h})
			}
			return ms, nil
		},
	}
}
