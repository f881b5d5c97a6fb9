package lease

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// timedCall is one Extend call as an extender saw it.
type timedCall struct {
	at       time.Time
	extendTo time.Duration
	ds       []*adapters.Delivery
}

// timedExtender records when each Extend happened and how far it extended.
type timedExtender struct {
	mu    sync.Mutex
	calls []timedCall
}

func (e *timedExtender) Extend(_ context.Context, ds []*adapters.Delivery, d time.Duration) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.calls = append(e.calls, timedCall{at: time.Now(), extendTo: d, ds: append([]*adapters.Delivery(nil), ds...)})
	return nil
}

func (e *timedExtender) of(d *adapters.Delivery) []timedCall {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []timedCall
	for _, c := range e.calls {
		for _, x := range c.ds {
			if x == d {
				out = append(out, c)
			}
		}
	}
	return out
}

// TestRenewsAtAFractionOfTheLease: the first renewal comes at about a third
// of the lease, well before the lease would run out, not near its end.
func TestRenewsAtAFractionOfTheLease(t *testing.T) {
	ext := &timedExtender{}
	const lease = 600 * time.Millisecond
	k := start(t, ext, Config{Lease: lease})
	d := &adapters.Delivery{ID: "d", ReceivedAt: time.Now()}
	k.Track(d)
	eventually(t, "first renewal", func() bool { return len(ext.of(d)) > 0 })
	if after := ext.of(d)[0].at.Sub(d.ReceivedAt); after > lease/2 {
		t.Fatalf("first renewal %v after receipt; want about lease/3 (%v), and before lease/2", after, lease/3)
	}
}

// TestStoppedLeaseIsNeverExtended: once Stop returns (the runtime is about to
// ack) the keeper never extends the delivery again, even if it was due.
func TestStoppedLeaseIsNeverExtended(t *testing.T) {
	ext := &timedExtender{}
	k := start(t, ext, Config{Lease: 30 * time.Millisecond})
	now := time.Now()
	stopped := &adapters.Delivery{ID: "stopped", ReceivedAt: now}
	kept := &adapters.Delivery{ID: "kept", ReceivedAt: now}
	l := k.Track(stopped)
	k.Track(kept)
	l.Stop()
	eventually(t, "the other lease renewed a few times", func() bool { return len(ext.of(kept)) >= 3 })
	if n := len(ext.of(stopped)); n != 0 {
		t.Fatalf("stopped lease extended %d times after Stop", n)
	}
	if k.Len() != 1 {
		t.Fatalf("keeper tracks %d leases, want 1", k.Len())
	}
}

// TestMaxHoldCapsEachExtension: no extension reaches past ReceivedAt+MaxHold
// (SQS refuses, and the cap is the user's promise of a bounded hold).
func TestMaxHoldCapsEachExtension(t *testing.T) {
	ext := &timedExtender{}
	const lease, maxHold = 90 * time.Millisecond, 150 * time.Millisecond
	k := start(t, ext, Config{Lease: lease, MaxHold: maxHold})
	d := &adapters.Delivery{ID: "d", ReceivedAt: time.Now()}
	k.Track(d)
	select {
	case <-d.Signal.Lost():
	case <-time.After(10 * time.Second):
		t.Fatal("delivery held past MaxHold")
	}
	calls := ext.of(d)
	if len(calls) == 0 {
		t.Fatal("never renewed")
	}
	cap := d.ReceivedAt.Add(maxHold)
	for i, c := range calls {
		if end := c.at.Add(c.extendTo); end.After(cap.Add(5 * time.Millisecond)) {
			t.Fatalf("extension %d (to %v at +%v) reaches %v past the MaxHold cap", i, c.extendTo, c.at.Sub(d.ReceivedAt), end.Sub(cap))
		}
	}
}

// TestFailedRenewalOfAStoppedLeaseIsNotALoss: the runtime stopped the lease
// (the delivery is being acked) while a renewal was on the wire; that renewal
// failing must not report the delivery lost (no false "lease lost" warning or
// count, no cancelled context for an acked message).
func TestFailedRenewalOfAStoppedLeaseIsNotALoss(t *testing.T) {
	rec := &recorder{
		block:   make(chan struct{}),
		entered: make(chan struct{}, 1),
		fail:    func(*adapters.Delivery) error { return errors.New("receipt handle is invalid") },
	}
	var lost atomic.Int32
	const lease = 30 * time.Millisecond
	k := start(t, rec, Config{Lease: lease, Lost: func(*adapters.Delivery, error) { lost.Add(1) }})
	d := &adapters.Delivery{ReceivedAt: time.Now()}
	l := k.Track(d)
	<-rec.entered
	stopped := make(chan struct{})
	go func() { l.Stop(); close(stopped) }()
	// The renewal fails once Stop waits for it (failing before, past the
	// lease, it rightly loses a delivery that nobody stopped: a fixed pause
	// let a slow start of Stop come after it), and once the lease has run
	// out, so that only the Stop keeps the failure from being a loss.
	eventually(t, "Stop waiting for the renewal", func() bool {
		k.mu.Lock()
		defer k.mu.Unlock()
		return k.t.slots[l.slot].stopped
	})
	time.Sleep(time.Until(d.ReceivedAt.Add(lease)))
	rec.mu.Lock()
	block := rec.block
	rec.block = nil
	rec.mu.Unlock()
	close(block)
	<-stopped
	time.Sleep(20 * time.Millisecond)
	if lost.Load() != 0 || d.Signal.LostCause() != nil {
		t.Fatalf("stopped lease reported lost (%d, %v)", lost.Load(), d.Signal.LostCause())
	}
}
