package jetstream

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/adaptertest"
)

func TestConformance(t *testing.T) {
	t.Parallel()
	adaptertest.Run(t, adaptertest.Harness{NewQueue: newConformanceQueue})
}

// newConformanceQueue makes a stream capturing NAME.> with a durable
// consumer whose AckWait is the lease asked for, and a dead-letter stream
// capturing NAME_dlq.> beside it. A message with key K is published on
// NAME.K (NAME.none without a key), so its Key is that subject; an ordered
// queue's Source orders by it (WithOrderedKeys).
func newConformanceQueue(t *testing.T, cfg adaptertest.QueueConfig) *adaptertest.Queue {
	e := newEnv(t)
	name := uniqueName(t)
	e.stream(name, false)
	dlqName := name + "_dlq"
	e.stream(dlqName, false)
	dlq, err := NewDeadLetter(e.ctx(), e.js, dlqName+".copies")
	if err != nil {
		t.Fatal(err)
	}
	lease := cfg.Lease
	if lease <= 0 {
		lease = 2 * time.Second
	}
	opts := []Option{
		WithCreate(jetstream.ConsumerConfig{AckWait: lease}),
		WithPollWait(500 * time.Millisecond),
	}
	if cfg.Ordered {
		opts = append(opts, WithOrderedKeys())
	}
	var (
		mu    sync.Mutex
		seen  = map[uint64]bool{} // dead-letter stream sequences already returned
		conns sync.Map            // *Source -> *nats.Conn
	)
	return &adaptertest.Queue{
		Lease: lease,
		Publish: func(ctx context.Context, msgs ...adaptertest.Message) error {
			for _, m := range msgs {
				key := m.Key
				if key == "" {
					key = "none"
				}
				e.publish(name+"."+key, m.Body, m.Headers)
			}
			return nil
		},
		Open: func(t *testing.T) adapters.Source {
			// A connection of its own, which Crash can close.
			own := connect(t, natsURL())
			src, err := New(e.ctx(), own.js, name, "custody", opts...)
			if err != nil {
				t.Fatal(err)
			}
			conns.Store(src, own.nc)
			return src
		},
		// Closing the connection sends what the client already wrote to it,
		// and nothing later.
		Crash: func(src adapters.Source) {
			nc, ok := conns.Load(src)
			if !ok {
				t.Fatalf("Crash: %T was not opened by this harness", src)
			}
			nc.(*nats.Conn).Close()
		},
		DeadLetter: dlq,
		DeadLettered: func(ctx context.Context) ([]adaptertest.Message, error) {
			ms, err := e.readAll(ctx, dlqName, "")
			if err != nil {
				return nil, err
			}
			mu.Lock()
			defer mu.Unlock()
			var out []adaptertest.Message
			for _, m := range ms {
				meta, err := m.Metadata()
				if err != nil {
					return nil, err
				}
				if seen[meta.Sequence.Stream] {
					continue
				}
				seen[meta.Sequence.Stream] = true
				h, err := copyHeaders(m)
				if err != nil {
					return nil, err
				}
				out = append(out, adaptertest.Message{Body: m.Data(), Headers: h})
			}
			return out, nil
		},
	}
}
