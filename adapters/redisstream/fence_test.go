package redisstream

import (
	"errors"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// TestStaleGiveBackNeverActsOnALaterDelivery gives an entry back, lets the
// same Source claim it again (its own reclaim of what it gave back), and
// then gives the first delivery back once more: what the runtime does when
// a give-back's answer was lost after Redis acted, and it tries the call
// again. The owner is the same consumer name, so only the delivery count
// tells the two deliveries apart: the stale give-back must fail with
// adapters.ErrLeaseLost and leave the later delivery held, or the Source
// claims the entry a third time while the second delivery's handler runs.
func TestStaleGiveBackNeverActsOnALaterDelivery(t *testing.T) {
	const lease = 300 * time.Millisecond
	e := newEnv(t)
	e.publish("one")
	a := e.open(WithLease(lease))
	defer a.Close()
	first := receiveN(t, a, 1)[0]
	if err := a.Nack(e.ctx(), adapters.NackAll([]*adapters.Delivery{first}, 0)); err != nil {
		t.Fatalf("Nack: %v", err)
	}
	second := receiveN(t, a, 1)[0] // claimed again at once: it was due
	if second.ID != first.ID || second.Attempt != 2 {
		t.Fatalf("got %s attempt %d, want %s attempt 2", second.ID, second.Attempt, first.ID)
	}
	err := a.Nack(e.ctx(), adapters.NackAll([]*adapters.Delivery{first}, 0))
	if e := adapters.EntryError(err, 0); !errors.Is(e, adapters.ErrLeaseLost) {
		t.Fatalf("giving back a delivery the same consumer claimed again since: %v, want an error wrapping adapters.ErrLeaseLost", err)
	}
	if p := e.pending(); len(p) != 1 || p[0].Consumer != a.Consumer() || p[0].Idle >= lease/2 || p[0].RetryCount != 2 {
		t.Fatalf("pending after the stale give-back: %+v, want the entry held (not idle), delivered twice", p)
	}
	// The later delivery is still this consumer's to renew and give back.
	if err := a.Extend(e.ctx(), []*adapters.Delivery{second}, lease); err != nil {
		t.Fatalf("renewing the later delivery: %v", err)
	}
	if err := a.Nack(e.ctx(), adapters.NackAll([]*adapters.Delivery{second}, time.Hour)); err != nil {
		t.Fatalf("giving back the later delivery: %v", err)
	}
}

// TestStaleRenewalNeverKeepsALaterDelivery lets a held entry go idle past
// the lease and has the same Source claim it again, then renews the first
// delivery: a renewal that checked the owner only would find this
// consumer's name and succeed, and the first delivery's handler would run
// on, its lease thought alive, beside the second's. It must fail with
// adapters.ErrLeaseLost, and leave the later delivery as it is.
func TestStaleRenewalNeverKeepsALaterDelivery(t *testing.T) {
	const lease = 200 * time.Millisecond
	e := newEnv(t)
	e.publish("one")
	a := e.open(WithLease(lease), WithReclaimInterval(10*time.Millisecond))
	defer a.Close()
	first := receiveN(t, a, 1)[0]
	second := receiveN(t, a, 1)[0] // claimed once idle for the lease
	if second.ID != first.ID || second.Attempt != 2 {
		t.Fatalf("got %s attempt %d, want %s attempt 2", second.ID, second.Attempt, first.ID)
	}
	err := a.Extend(e.ctx(), []*adapters.Delivery{first}, lease)
	if e := adapters.EntryError(err, 0); !errors.Is(e, adapters.ErrLeaseLost) {
		t.Fatalf("renewing a delivery the same consumer claimed again since: %v, want an error wrapping adapters.ErrLeaseLost", err)
	}
	if err := a.Extend(e.ctx(), []*adapters.Delivery{second}, lease); err != nil {
		t.Fatalf("renewing the later delivery: %v", err)
	}
	if got := a.Stats().LeaseLost; got != 1 {
		t.Errorf("Stats.LeaseLost = %d, want 1", got)
	}
}
