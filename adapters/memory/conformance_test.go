package memory_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/adaptertest"
	"github.com/custody-go/custody/adapters/memory"
)

func TestConformance(t *testing.T) {
	adaptertest.Run(t, adaptertest.Harness{NewQueue: newTestQueue})
}

// newTestQueue scales the suite's leases down by 2: the memory broker keeps
// time in milliseconds, so its run of the suite stays fast, while a renewal
// at a third of the lease still has room on a loaded machine under -race.
func newTestQueue(t *testing.T, cfg adaptertest.QueueConfig) *adaptertest.Queue {
	b := memory.NewBroker()
	lease := cfg.Lease / 2
	if lease <= 0 {
		lease = 100 * time.Millisecond
	}
	if err := b.CreateQueue("dlq", memory.QueueOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := b.CreateQueue("q", memory.QueueOptions{Lease: lease, FIFO: cfg.Ordered}); err != nil {
		t.Fatal(err)
	}
	dlq, err := b.DeadLetterQueue("dlq")
	if err != nil {
		t.Fatal(err)
	}
	return &adaptertest.Queue{
		Lease: lease,
		Publish: func(ctx context.Context, msgs ...adaptertest.Message) error {
			for _, m := range msgs {
				if err := b.Publish(ctx, "q", memory.Message{Body: m.Body, Headers: m.Headers, Key: m.Key}); err != nil {
					return err
				}
			}
			return nil
		},
		Open: func(t *testing.T) adapters.Source {
			src, err := b.Source("q", memory.WithPollWait(20*time.Millisecond))
			if err != nil {
				t.Fatal(err)
			}
			return src
		},
		DeadLetter: dlq,
		DeadLettered: func(ctx context.Context) ([]adaptertest.Message, error) {
			ms, err := b.Messages("dlq")
			out := make([]adaptertest.Message, len(ms))
			for i, m := range ms {
				out[i] = adaptertest.Message{Key: m.Key, Body: m.Body, Headers: m.Headers}
			}
			return out, err
		},
		Crash: func(src adapters.Source) { src.(*memory.Source).Crash() },
		Refuse: func(src adapters.Source) {
			var refused atomic.Bool
			src.(*memory.Source).SetFaults(memory.Faults{Ack: func(d *adapters.Delivery) error {
				if refused.CompareAndSwap(false, true) {
					return errors.New("memory: refused by the conformance harness, as a broker under strain would")
				}
				return nil
			}})
		},
	}
}
