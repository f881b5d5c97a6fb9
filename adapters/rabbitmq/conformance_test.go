package rabbitmq

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/adaptertest"
)

func TestConformanceClassic(t *testing.T) {
	adaptertest.Run(t, harness(ClassicQueue))
}

func TestConformanceQuorum(t *testing.T) {
	adaptertest.Run(t, harness(QuorumQueue))
}

func harness(typ QueueType) adaptertest.Harness {
	return adaptertest.Harness{
		NewQueue: harnessQueue(typ),
		Dispatch: adaptertest.Prefetch,
	}
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
		var cutters sync.Map // *Source -> *cutter
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
				c := &cutter{}
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				opts := []Option{WithDialFunc(c.dial), WithPrefetch(64), WithPollWait(200 * time.Millisecond)}
				if typ == QuorumQueue {
					// Declared, the Source knows the broker counts deliveries.
					opts = append(opts, WithDeclare(QuorumQueue, nil))
				}
				s, err := New(ctx, q, opts...)
				if err != nil {
					t.Fatalf("New: %v", err)
				}
				t.Cleanup(func() { s.Close() })
				cutters.Store(s, c)
				return s
			},
			DeadLetter: openSink(t, "", dlq),
			DeadLettered: func(ctx context.Context) ([]adaptertest.Message, error) {
				var out []adaptertest.Message
				for _, m := range a.drain(dlq) {
					out = append(out, adaptertest.Message{Body: m.Body, Headers: stringHeaders(m.Headers)})
				}
				return out, nil
			},
			Crash: func(src adapters.Source) {
				c, ok := cutters.Load(src)
				if !ok {
					t.Fatalf("Crash: %T was not opened by this harness", src)
				}
				c.(*cutter).cut()
			},
		}
	}
}

// errCut is what a Source cut off by its harness gets when it dials.
var errCut = errors.New("cut off by the conformance harness")

// cutter dials a Source's connections and can cut them all, as the death of
// the Source's process would, but in an order the broker keeps: it closes
// each connection with connection.close, which the broker handles after
// every frame sent before (an ack written just before a socket dies can be
// lost with it, which the contract allows and the suite must not mistake
// for a linger), and refuses new connections.
type cutter struct {
	mu    sync.Mutex
	done  bool
	conns []*amqp.Connection
}

func (c *cutter) dial(ctx context.Context) (*amqp.Connection, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done {
		return nil, errCut
	}
	conn, err := amqp.DialConfig(brokerURL, amqp.Config{Dial: amqp.DefaultDial(30 * time.Second)})
	if err != nil {
		return nil, err
	}
	c.conns = append(c.conns, conn)
	return conn, nil
}

func (c *cutter) cut() {
	c.mu.Lock()
	c.done = true
	conns := c.conns
	c.mu.Unlock()
	for _, conn := range conns {
		_ = conn.Close() // returns once the broker answered, or at once if already closed
	}
}
