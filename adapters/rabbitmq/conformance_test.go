package rabbitmq

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/adaptertest"
)

func TestConformanceClassic(t *testing.T) {
	adaptertest.Run(t, adaptertest.Harness{NewQueue: harnessQueue(ClassicQueue)})
}

func TestConformanceQuorum(t *testing.T) {
	adaptertest.Run(t, adaptertest.Harness{NewQueue: harnessQueue(QuorumQueue)})
}

// harnessQueue gives each conformance test a fresh queue of the given type
// with a dead-letter queue beside it, fed by a DeadLetter sink.
func harnessQueue(typ QueueType) func(t *testing.T, cfg adaptertest.QueueConfig) *adaptertest.Queue {
	return func(t *testing.T, cfg adaptertest.QueueConfig) *adaptertest.Queue {
		if cfg.Ordered {
			t.Skip("a RabbitMQ queue consumed concurrently does not keep order per key")
		}
		a := newAdmin(t)
		q := a.queue(typ, nil)
		dlq := a.queue(ClassicQueue, nil)
		return &adaptertest.Queue{
			Publish: func(ctx context.Context, msgs ...adaptertest.Message) error {
				for _, m := range msgs {
					h := amqp.Table{}
					for k, v := range m.Headers {
						h[k] = v
					}
					a.publishMsg(q, amqp.Publishing{Body: m.Body, Headers: h, DeliveryMode: amqp.Persistent, Timestamp: time.Now()})
				}
				return nil
			},
			Open: func(t *testing.T) adapters.Source {
				opts := []Option{WithPrefetch(64), WithPollWait(200 * time.Millisecond)}
				if typ == QuorumQueue {
					// Declared, the Source knows the broker counts deliveries.
					opts = append(opts, WithDeclare(QuorumQueue, nil))
				}
				return openSource(t, q, opts...)
			},
			DeadLetter: openSink(t, "", dlq),
			DeadLettered: func(ctx context.Context) ([]adaptertest.Message, error) {
				var out []adaptertest.Message
				for _, m := range a.drain(dlq) {
					out = append(out, adaptertest.Message{Body: m.Body, Headers: stringHeaders(m.Headers)})
				}
				return out, nil
			},
		}
	}
}
