package lease

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// blockingLost is a Config.Lost that parks the keeper in the callback for
// the first delivery it reports, until release is closed.
type blockingLost struct {
	mu      sync.Mutex
	first   *adapters.Delivery
	reports []*adapters.Delivery
	entered chan *adapters.Delivery
	release chan struct{}
}

func newBlockingLost() *blockingLost {
	return &blockingLost{entered: make(chan *adapters.Delivery, 1), release: make(chan struct{})}
}

func (b *blockingLost) lost(d *adapters.Delivery, _ error) {
	b.mu.Lock()
	b.reports = append(b.reports, d)
	first := b.first == nil
	if first {
		b.first = d
	}
	b.mu.Unlock()
	if first {
		b.entered <- d
		<-b.release
	}
}

func (b *blockingLost) reported(d *adapters.Delivery) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for _, x := range b.reports {
		if x == d {
			n++
		}
	}
	return n
}

// checkLossIsDecidedByStop runs the scenario of a keeper losing two leases
// at once while the runtime stops one of them (its handler finished; it is
// about to ack): the keeper is parked in the Lost report of the first, and
// the second is stopped. Once Stop returns, the delivery's fate must be
// settled: either it is lost already (the runtime sees LostCause and counts
// it), or it is never lost nor reported lost afterwards (it was acked).
func checkLossIsDecidedByStop(t *testing.T, cancel context.CancelFunc, done <-chan struct{}, bl *blockingLost, leases map[*adapters.Delivery]*Lease) {
	t.Helper()
	var first *adapters.Delivery
	select {
	case first = <-bl.entered:
	case <-time.After(20 * time.Second):
		t.Fatal("no delivery was lost")
	}
	var other *adapters.Delivery
	for d := range leases {
		if d != first {
			other = d
		}
	}
	var causeAtStop error
	stopped := make(chan struct{})
	go func() {
		leases[other].Stop()
		causeAtStop = other.Signal.LostCause()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(200 * time.Millisecond):
		// Stop waits for the keeper: fine, as long as the outcome is
		// consistent once it returns.
	}
	close(bl.release)
	<-stopped
	cancel()
	<-done // every loss the keeper decided has been made and reported
	if causeAtStop == nil {
		if cause := other.Signal.LostCause(); cause != nil {
			t.Fatalf("Stop returned with the delivery held, and the keeper lost it afterwards (%v): the runtime acks it and its loss goes unseen, or is counted for an acked message", cause)
		}
		if n := bl.reported(other); n != 0 {
			t.Fatalf("Lost reported a delivery %d time(s) after its lease was stopped while it was held", n)
		}
	}
}

// TestMaxHoldLossDoesNotRaceStop: two leases reach MaxHold together; a Stop
// of the second, arriving while the keeper is busy losing the first, must
// not return before the keeper decided the second's fate.
func TestMaxHoldLossDoesNotRaceStop(t *testing.T) {
	bl := newBlockingLost()
	k, err := New(&recorder{}, Config{Lease: time.Minute, MaxHold: 50 * time.Millisecond, Lost: bl.lost})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	leases := map[*adapters.Delivery]*Lease{}
	for _, id := range []string{"a", "b"} {
		d := &adapters.Delivery{ID: id, ReceivedAt: now}
		leases[d] = k.Track(d)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { k.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	checkLossIsDecidedByStop(t, cancel, done, bl, leases)
}

// TestRefusedRenewalLossDoesNotRaceStop: the same for two leases whose
// renewal, in one batch, the adapter refuses as lost.
func TestRefusedRenewalLossDoesNotRaceStop(t *testing.T) {
	bl := newBlockingLost()
	rec := &recorder{fail: func(*adapters.Delivery) error {
		return fmt.Errorf("stale receipt: %w", adapters.ErrLeaseLost)
	}}
	k, err := New(rec, Config{Lease: 60 * time.Millisecond, Lost: bl.lost})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	leases := map[*adapters.Delivery]*Lease{}
	for _, id := range []string{"a", "b"} {
		d := &adapters.Delivery{ID: id, ReceivedAt: now}
		leases[d] = k.Track(d)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { k.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	checkLossIsDecidedByStop(t, cancel, done, bl, leases)
}

// TestStoppedLeaseIsNotRenewedWhileItsBatchWaits: a lease taken for renewal
// whose batch waits for a free Extend slot (Parallel) is stopped meanwhile
// (its handler finished). The renewal must not be sent: the delivery is
// about to be acked, and renewing it only costs a call.
func TestStoppedLeaseIsNotRenewedWhileItsBatchWaits(t *testing.T) {
	rec := &recorder{block: make(chan struct{}), entered: make(chan struct{}, 1)}
	k := start(t, rec, Config{Lease: 300 * time.Millisecond, MaxBatch: 1, Parallel: 1})
	now := time.Now()
	ds := []*adapters.Delivery{{ID: "a", ReceivedAt: now}, {ID: "b", ReceivedAt: now}}
	leases := map[*adapters.Delivery]*Lease{}
	for _, d := range ds {
		leases[d] = k.Track(d)
	}
	<-rec.entered // one renewal is on the wire and blocked
	rec.mu.Lock()
	onWire := rec.calls[0][0]
	rec.mu.Unlock()
	waiting := ds[0]
	if waiting == onWire {
		waiting = ds[1]
	}
	l := leases[waiting]
	eventually(t, "the other lease taken for renewal", func() bool {
		k.mu.Lock()
		defer k.mu.Unlock()
		return k.t.slots[l.slot].renewing != nil
	})
	stopped := make(chan struct{})
	go func() { l.Stop(); close(stopped) }()
	eventually(t, "Stop marked the lease", func() bool {
		k.mu.Lock()
		defer k.mu.Unlock()
		return k.t.slots[l.slot].stopped
	})
	rec.mu.Lock()
	block := rec.block
	rec.block = nil
	rec.mu.Unlock()
	close(block)
	<-stopped
	if n := rec.count(waiting); n != 0 {
		t.Fatalf("a lease stopped before its renewal was sent was renewed %d time(s)", n)
	}
	leases[onWire].Stop()
}

// TestFailingRenewalsDoNotHotLoop: renewals that keep failing fast (a
// throttled or unreachable broker) are tried again every sixth of the
// lease, then at half of what is left, while more than a twelfth is left:
// a handful of calls, not one call after another for the last part of the
// lease.
func TestFailingRenewalsDoNotHotLoop(t *testing.T) {
	rec := &recorder{callErr: func(int) error { return errors.New("throttled") }}
	const lease = 2400 * time.Millisecond
	k := start(t, rec, Config{Lease: lease})
	d := &adapters.Delivery{ID: "d", ReceivedAt: time.Now()}
	k.Track(d)
	select {
	case <-d.Signal.Lost():
	case <-time.After(30 * time.Second):
		t.Fatal("failing renewals did not lose the delivery")
	}
	// At 1/3, 1/2, 2/3 and 5/6 of the lease, then at 11/12: five calls, a
	// few more if the machine is slow to wake; never hundreds.
	if n := rec.count(d); n > 8 {
		t.Fatalf("%d renewal attempts for one lease over %v; retries hot-loop", n, lease)
	}
}

// TestNoTinyRenewalBeforeMaxHold: a lease whose last extension already runs
// to MaxHold is not renewed again when another lease wakes the keeper just
// before the cap: that would be a call for nothing (and, on SQS, a renewal
// rounded up past the cap).
func TestNoTinyRenewalBeforeMaxHold(t *testing.T) {
	ext := &timedExtender{}
	const lease, maxHold = 3 * time.Second, 2500 * time.Millisecond
	k := start(t, ext, Config{Lease: lease, MaxHold: maxHold})
	t0 := time.Now()
	a := &adapters.Delivery{ID: "a", ReceivedAt: t0}
	// b falls due (at 1.3s+1s = 2.3s) within the slack (lease/12 = 250ms)
	// before a's cap at 2.5s, so a is taken along with it.
	b := &adapters.Delivery{ID: "b", ReceivedAt: t0.Add(1300 * time.Millisecond)}
	k.Track(a)
	k.Track(b)
	select {
	case <-a.Signal.Lost():
	case <-time.After(30 * time.Second):
		t.Fatal("a held past MaxHold")
	}
	// An extension shorter than the lease is cut to run to the cap: it is
	// the last one.
	calls := ext.of(a)
	for i, c := range calls[:max(len(calls)-1, 0)] {
		if c.extendTo < lease {
			last := calls[len(calls)-1]
			t.Fatalf("a renewed %d time(s) after renewal %d ran its lease to the cap; the last extends it by %v at +%v",
				len(calls)-1-i, i, last.extendTo, last.at.Sub(t0))
		}
	}
}

// ctxExtender fails a renewal the way a client does when its context ends.
type ctxExtender struct {
	entered chan *adapters.Delivery
}

func (e *ctxExtender) Extend(ctx context.Context, ds []*adapters.Delivery, _ time.Duration) error {
	for _, d := range ds {
		select {
		case e.entered <- d:
		default:
		}
	}
	<-ctx.Done()
	return fmt.Errorf("extend: %w", ctx.Err())
}

// TestShutdownIsNotARenewalFailure: a renewal cut short because Run's
// context ended is not a failed renewal: the keeper is stopping, so it
// neither reports it as failing (Retrying) nor loses the delivery.
func TestShutdownIsNotARenewalFailure(t *testing.T) {
	bl := newBlockingLost()
	ext := &ctxExtender{entered: make(chan *adapters.Delivery, 1)}
	var retrying atomic.Int32
	// The lease is long enough that the renewal on the wire is cut by the
	// shutdown, not by the approaching end of its lease (which would rightly
	// lose the delivery), however slowly the machine runs.
	k, err := New(ext, Config{Lease: 3 * time.Second, MaxHold: 4 * time.Second, Timeout: time.Minute,
		Lost: bl.lost, Retrying: func(n int, _ error) { retrying.Add(int32(n)) }})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	renewing := &adapters.Delivery{ID: "renewing", ReceivedAt: now}
	capped := &adapters.Delivery{ID: "capped", ReceivedAt: now.Add(-3950 * time.Millisecond)} // at its cap at +50ms
	k.Track(renewing)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { k.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	<-ext.entered // renewing's renewal is on the wire
	k.Track(capped)
	// The keeper is now busy reporting capped lost; meanwhile Run's
	// context ends, which ends the renewal on the wire.
	if d := <-bl.entered; d != capped {
		t.Fatalf("lost %s first", d.ID)
	}
	cancel()
	time.Sleep(100 * time.Millisecond) // let the renewal come back
	close(bl.release)
	<-done
	if n := retrying.Load(); n != 0 {
		t.Errorf("Retrying reported %d lease(s) for a renewal cut short by shutdown", n)
	}
	if cause := renewing.Signal.LostCause(); cause != nil || bl.reported(renewing) != 0 {
		t.Errorf("a renewal cut short by shutdown lost the delivery: %v", cause)
	}
}

// TestLenCountsLeasesOnTheWire: a lease whose renewal is on the wire is still
// kept.
func TestLenCountsLeasesOnTheWire(t *testing.T) {
	rec := &recorder{block: make(chan struct{}), entered: make(chan struct{}, 1)}
	k := start(t, rec, Config{Lease: 30 * time.Millisecond})
	d := &adapters.Delivery{ID: "d", ReceivedAt: time.Now()}
	l := k.Track(d)
	<-rec.entered
	if n := k.Len(); n != 1 {
		t.Errorf("Len() = %d with the lease's renewal on the wire, want 1", n)
	}
	stopped := make(chan struct{})
	go func() { l.Stop(); close(stopped) }()
	rec.mu.Lock()
	block := rec.block
	rec.block = nil
	rec.mu.Unlock()
	close(block)
	<-stopped
	if n := k.Len(); n != 0 {
		t.Fatalf("Len() = %d after Stop, want 0", n)
	}
}

// hangingFirstCall is an Extender whose first call hangs until its context
// ends, as a call to a broker that stopped answering does, and whose later
// calls succeed.
type hangingFirstCall struct{ calls atomic.Int32 }

func (e *hangingFirstCall) Extend(ctx context.Context, _ []*adapters.Delivery, _ time.Duration) error {
	if e.calls.Add(1) == 1 {
		<-ctx.Done()
		return fmt.Errorf("extend: %w", ctx.Err())
	}
	return nil
}

// TestHungRenewalIsCutAtTheTimeoutAndTriedAgain: a renewal call that hangs
// is cut short at Config.Timeout and tried again while the lease lasts, so
// the delivery is kept. Left hanging, it held its lease (and a Stop of it,
// which the runtime calls before the ack) until the broker answered, and
// the lease ran out meanwhile.
func TestHungRenewalIsCutAtTheTimeoutAndTriedAgain(t *testing.T) {
	ext := &hangingFirstCall{}
	var retrying atomic.Int32
	// Renewed every second; the retry comes half a second after the cut,
	// well before the three-second lease runs out.
	k := start(t, ext, Config{Lease: 3 * time.Second, Timeout: 100 * time.Millisecond,
		Retrying: func(n int, _ error) { retrying.Add(int32(n)) }})
	d := &adapters.Delivery{ReceivedAt: time.Now()}
	l := k.Track(d)
	eventually(t, "the renewal tried again", func() bool { return ext.calls.Load() >= 2 })
	l.Stop()
	if cause := d.Signal.LostCause(); cause != nil {
		t.Fatalf("lost after a hung renewal: %v", cause)
	}
	// Retrying reports after its call returned, maybe after the next call.
	eventually(t, "the cut call reported", func() bool { return retrying.Load() >= 1 })
	if n := retrying.Load(); n != 1 {
		t.Errorf("Retrying reported %d leases, want 1: the hung call", n)
	}
}

// hangingExtender never answers: each call returns when its context ends,
// and records the context's deadline.
type hangingExtender struct {
	mu        sync.Mutex
	deadlines []time.Time
}

func (e *hangingExtender) Extend(ctx context.Context, _ []*adapters.Delivery, _ time.Duration) error {
	dl, _ := ctx.Deadline()
	e.mu.Lock()
	e.deadlines = append(e.deadlines, dl)
	e.mu.Unlock()
	<-ctx.Done()
	return fmt.Errorf("extend: %w", ctx.Err())
}

// TestHungRenewalEndsBeforeTheLeaseRunsOut: a renewal the broker never
// answers is given up before the lease runs out, whatever Config.Timeout
// says, so that the delivery is lost (its handler cancelled) before the
// broker hands the message to another consumer. Bounded by the timeout
// alone, a retry sent late in the lease kept the lease alive in the
// keeper's eyes past its end, the handler running beside the redelivery.
func TestHungRenewalEndsBeforeTheLeaseRunsOut(t *testing.T) {
	ext := &hangingExtender{}
	const leaseLen = 1200 * time.Millisecond
	k := start(t, ext, Config{Lease: leaseLen, Timeout: time.Minute})
	d := &adapters.Delivery{ID: "d", ReceivedAt: time.Now()}
	k.Track(d)
	select {
	case <-d.Signal.Lost():
	case <-time.After(20 * time.Second):
		t.Fatal("a lease whose renewals never return was not lost")
	}
	if !errors.Is(d.Signal.LostCause(), adapters.ErrLeaseLost) {
		t.Errorf("cause %v does not wrap ErrLeaseLost", d.Signal.LostCause())
	}
	ext.mu.Lock()
	defer ext.mu.Unlock()
	end := d.ReceivedAt.Add(leaseLen)
	for i, dl := range ext.deadlines {
		if dl.IsZero() || !dl.Before(end) {
			t.Errorf("renewal %d could wait for its answer until %v, past the lease's end (%v after it)", i, dl, dl.Sub(end))
		}
	}
}
