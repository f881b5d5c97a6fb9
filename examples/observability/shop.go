package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
)

// order is a message's body.
type order struct {
	ID     string `json:"id"`
	Amount int    `json:"amount"`
	// The failures the demo plays, each on the order's first delivery.
	Flaky bool `json:"flaky,omitempty"` // the payment call times out
	Panic bool `json:"panic,omitempty"` // the handler panics
	// SlowMS makes the payment call take that long, without heeding the
	// handler's context.
	SlowMS int `json:"slow_ms,omitempty"`
}

// The orders whose deliveries the broker mistreats (see faults).
const (
	ackLostOrder   = "ack-lost"   // its first ack fails
	leaseLostOrder = "lease-lost" // its first delivery's lease renewal is refused
)

// shop is the handler's world: a payment service that can go down, the
// ledger of effects applied, and the faults the broker injects.
type shop struct {
	paymentsDown atomic.Bool
	ledger       ledger

	mu        sync.Mutex
	ackFailed map[string]bool // orders whose ack failed once already
}

func newShop() *shop {
	return &shop{ledger: ledger{applied: map[string]int{}}, ackFailed: map[string]bool{}}
}

// handle charges an order and records its effect.
func (s *shop) handle(ctx context.Context, m *consumer.Message) error {
	var o order
	// No retry can fix a message that does not parse: it is dead-lettered
	// at once.
	if err := json.Unmarshal(m.Body, &o); err != nil {
		return consumer.Permanent(fmt.Errorf("decoding order: %w", err))
	}
	if o.ID == "" {
		return consumer.Permanent(errors.New("decoding order: no id"))
	}
	if o.Panic && m.Attempt == 1 {
		panic("tax table not loaded") // recovered, counted, retried
	}
	if o.Flaky && m.Attempt == 1 {
		return errors.New("payments: request timed out") // retried after a backoff
	}
	if s.paymentsDown.Load() {
		// Not the message's fault: no attempt is used up, the message
		// waits in place, and the kill switch counts the failure.
		return consumer.Unavailable(errors.New("payments: connection refused"))
	}
	if o.SlowMS > 0 {
		// A call that does not take a context: it runs on after the
		// lease is lost and the handler's context is cancelled, which is
		// how a redelivery comes to overlap the original.
		time.Sleep(time.Duration(o.SlowMS) * time.Millisecond)
	}
	s.ledger.apply(o.ID)
	return nil
}

// faults makes the broker fail the first ack of ackLostOrder (a network
// error: the ack is lost, the broker redelivers the message when its lease
// runs out) and refuse the lease renewal of leaseLostOrder's first delivery
// (as SQS refuses a stale receipt handle).
func (s *shop) faults() memory.Faults {
	return memory.Faults{
		Ack: func(d *adapters.Delivery) error {
			if d.Headers["order-id"] != ackLostOrder {
				return nil
			}
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.ackFailed[d.ID] {
				return nil
			}
			s.ackFailed[d.ID] = true
			return errors.New("connection reset by peer")
		},
		Extend: func(d *adapters.Delivery) error {
			if d.Headers["order-id"] == leaseLostOrder && d.Attempt == 1 {
				return fmt.Errorf("receipt handle expired: %w", adapters.ErrLeaseLost)
			}
			return nil
		},
	}
}
