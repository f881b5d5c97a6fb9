package lease

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// recorder is an Extender that records calls and can fail or block them.
type recorder struct {
	mu      sync.Mutex
	calls   [][]*adapters.Delivery
	fail    func(d *adapters.Delivery) error
	callErr func(call int) error // fails whole calls (numbered from 1)
	block   chan struct{}
	entered chan struct{}
}

func (r *recorder) Extend(ctx context.Context, ds []*adapters.Delivery, d time.Duration) error {
	r.mu.Lock()
	r.calls = append(r.calls, append([]*adapters.Delivery(nil), ds...))
	fail, block, entered := r.fail, r.block, r.entered
	call := len(r.calls)
	r.mu.Unlock()
	if r.callErr != nil {
		if err := r.callErr(call); err != nil {
			return err
		}
	}
	if entered != nil {
		select {
		case entered <- struct{}{}:
		default:
		}
	}
	if block != nil {
		<-block
	}
	var failed map[int]error
	for i, dl := range ds {
		if fail != nil {
			if err := fail(dl); err != nil {
				if failed == nil {
					failed = map[int]error{}
				}
				failed[i] = err
			}
		}
	}
	if failed != nil {
		return &adapters.BatchError{Failed: failed}
	}
	return nil
}

func (r *recorder) count(d *adapters.Delivery) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, c := range r.calls {
		for _, x := range c {
			if x == d {
				n++
			}
		}
	}
	return n
}

func start(t *testing.T, ext adapters.Extender, cfg Config) *Keeper {
	t.Helper()
	k, err := New(ext, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { k.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return k
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestRenewsAtAFractionInBatches(t *testing.T) {
	rec := &recorder{}
	k := start(t, rec, Config{Lease: 90 * time.Millisecond, MaxBatch: 10})
	now := time.Now()
	ds := make([]*adapters.Delivery, 25)
	for i := range ds {
		ds[i] = &adapters.Delivery{ID: "d", ReceivedAt: now}
		k.Track(ds[i])
	}
	eventually(t, "every lease renewed twice", func() bool {
		for _, d := range ds {
			if rec.count(d) < 2 {
				return false
			}
		}
		return true
	})
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, c := range rec.calls {
		if len(c) > 10 {
			t.Fatalf("batch of %d, above MaxBatch 10", len(c))
		}
	}
	// 25 leases due together: three calls per round, not 25.
	if len(rec.calls) > 3*4 {
		t.Fatalf("%d Extend calls for 25 leases over about two rounds; renewals are not batched", len(rec.calls))
	}
}

func TestStopWaitsForARenewalOnTheWire(t *testing.T) {
	rec := &recorder{block: make(chan struct{}), entered: make(chan struct{}, 1)}
	k := start(t, rec, Config{Lease: 30 * time.Millisecond})
	d := &adapters.Delivery{ReceivedAt: time.Now()}
	l := k.Track(d)
	<-rec.entered // a renewal of d is in flight and blocked
	stopped := make(chan struct{})
	go func() { l.Stop(); close(stopped) }()
	select {
	case <-stopped:
		t.Fatal("Stop returned while a renewal of the lease was still on the wire")
	case <-time.After(50 * time.Millisecond):
	}
	rec.mu.Lock()
	block := rec.block
	rec.block = nil
	rec.mu.Unlock()
	close(block)
	<-stopped
	n := rec.count(d)
	time.Sleep(100 * time.Millisecond)
	if rec.count(d) != n {
		t.Fatal("lease renewed after Stop returned")
	}
}

// A renewal that keeps failing without saying the lease is gone is tried
// again until the lease runs out, and the delivery is lost then.
func TestFailedRenewalLosesTheDelivery(t *testing.T) {
	rec := &recorder{fail: func(d *adapters.Delivery) error {
		if d.ID == "bad" {
			return errors.New("service unavailable")
		}
		return nil
	}}
	var lost atomic.Int32
	// The lease leaves room for a late first renewal: on a loaded machine
	// the keeper can wake tens of milliseconds after the renewal was due,
	// and with a 30 ms lease the one failed attempt then came within the
	// slack of the expiry, which rightly loses the delivery without a retry.
	// (Due at 500 ms, failing, retried at 750, 1000, 1250 and 1375 ms.)
	k := start(t, rec, Config{Lease: 1500 * time.Millisecond, Lost: func(*adapters.Delivery, error) { lost.Add(1) }})
	good := &adapters.Delivery{ID: "good", ReceivedAt: time.Now()}
	bad := &adapters.Delivery{ID: "bad", ReceivedAt: time.Now()}
	k.Track(good)
	k.Track(bad)
	select {
	case <-bad.Signal.Lost():
	case <-time.After(10 * time.Second):
		t.Fatal("failed renewal did not lose the delivery")
	}
	if !errors.Is(bad.Signal.LostCause(), adapters.ErrLeaseLost) {
		t.Fatalf("cause %v does not wrap ErrLeaseLost", bad.Signal.LostCause())
	}
	if n := rec.count(bad); n < 2 {
		t.Fatalf("lost after %d renewal attempt(s); a failure that does not say the lease is gone is retried while it lasts", n)
	}
	eventually(t, "good renewed again", func() bool { return rec.count(good) >= 3 })
	// Lost reports the loss after the delivery is lost: wait for it.
	eventually(t, "the loss reported", func() bool { return lost.Load() >= 1 })
	if good.Signal.LostCause() != nil || lost.Load() != 1 {
		t.Fatalf("good lost: %v; lost count %d", good.Signal.LostCause(), lost.Load())
	}
	// Two more renewals of good span a whole renewal interval, longer than
	// any retry of bad would wait.
	n, g := rec.count(bad), rec.count(good)
	eventually(t, "good renewed twice more", func() bool { return rec.count(good) >= g+2 })
	if rec.count(bad) != n {
		t.Fatal("a lost lease was renewed again")
	}
}

// A renewal refused because the lease is gone (the error wraps
// ErrLeaseLost) loses the delivery at once: retrying could only fail again,
// and its handler should stop before the broker's redelivery runs it twice.
func TestRenewalRefusedAsLostLosesAtOnce(t *testing.T) {
	rec := &recorder{fail: func(d *adapters.Delivery) error {
		return fmt.Errorf("stale receipt: %w", adapters.ErrLeaseLost)
	}}
	k := start(t, rec, Config{Lease: 300 * time.Millisecond})
	d := &adapters.Delivery{ReceivedAt: time.Now()}
	k.Track(d)
	select {
	case <-d.Signal.Lost():
	case <-time.After(10 * time.Second):
		t.Fatal("refused renewal did not lose the delivery")
	}
	if n := rec.count(d); n != 1 {
		t.Fatalf("%d renewal attempts; a lease the adapter reports gone is not retried", n)
	}
}

// A transient failure (the whole call failed: a network error, throttling)
// leaves the lease as last granted; the renewal is tried again before it
// runs out, and the delivery is kept.
func TestTransientRenewalFailureIsRetriedWhileTheLeaseLasts(t *testing.T) {
	rec := &recorder{callErr: func(call int) error {
		if call <= 2 {
			return errors.New("throttled")
		}
		return nil
	}}
	var retrying atomic.Int32
	k := start(t, rec, Config{Lease: 1500 * time.Millisecond,
		Retrying: func(n int, err error) { retrying.Add(int32(n)) }})
	d := &adapters.Delivery{ReceivedAt: time.Now()}
	k.Track(d)
	eventually(t, "two renewals after the failures", func() bool { return rec.count(d) >= 4 })
	if cause := d.Signal.LostCause(); cause != nil {
		t.Fatalf("lost after transient failures: %v", cause)
	}
	// Retrying reports after its call returned, maybe after the next call.
	eventually(t, "the failures reported", func() bool { return retrying.Load() >= 2 })
	if n := retrying.Load(); n != 2 {
		t.Fatalf("Retrying reported %d leases, want 2 (one per failed call)", n)
	}
}

func TestMaxHoldCapsTotalExtension(t *testing.T) {
	rec := &recorder{}
	k := start(t, rec, Config{Lease: 30 * time.Millisecond, MaxHold: 100 * time.Millisecond})
	d := &adapters.Delivery{ReceivedAt: time.Now()}
	k.Track(d)
	select {
	case <-d.Signal.Lost():
	case <-time.After(10 * time.Second):
		t.Fatal("delivery held past MaxHold")
	}
	if !errors.Is(d.Signal.LostCause(), ErrMaxHold) {
		t.Fatalf("cause = %v, want ErrMaxHold", d.Signal.LostCause())
	}
	if held := time.Since(d.ReceivedAt); held < 100*time.Millisecond {
		t.Fatalf("lost after %v, before MaxHold", held)
	}
}

func TestConfigIsChecked(t *testing.T) {
	if _, err := New(&recorder{}, Config{}); err == nil {
		t.Error("zero Lease accepted")
	}
	if _, err := New(&recorder{}, Config{Lease: time.Second, Fraction: 1}); err == nil {
		t.Error("Fraction 1 accepted")
	}
	if _, err := New(&recorder{}, Config{Lease: time.Second, Fraction: math.NaN()}); err == nil {
		t.Error("Fraction NaN accepted: every renewal would come due at once")
	}
	if _, err := New(nil, Config{Lease: time.Second}); err == nil {
		t.Error("nil Extender accepted")
	}
}

type nopExtender struct{ n atomic.Int64 }

func (e *nopExtender) Extend(ctx context.Context, ds []*adapters.Delivery, d time.Duration) error {
	e.n.Add(int64(len(ds)))
	return nil
}

// BenchmarkKeeper100k tracks 100,000 leases of 300ms and lets them renew for
// b.N rounds, reporting CPU time per renewal and the goroutines in use.
func BenchmarkKeeper100k(b *testing.B) {
	const leases = 100_000
	ext := &nopExtender{}
	k, err := New(ext, Config{Lease: 300 * time.Millisecond, MaxBatch: 100})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	before := runtime.NumGoroutine()
	go func() { k.Run(ctx); close(done) }()
	now := time.Now()
	for i := 0; i < leases; i++ {
		k.Track(&adapters.Delivery{ReceivedAt: now})
	}
	b.ResetTimer()
	start := cpuTime()
	var peak int
	target := int64(leases) * int64(b.N)
	for ext.n.Load() < target {
		if g := runtime.NumGoroutine() - before; g > peak {
			peak = g
		}
		time.Sleep(5 * time.Millisecond)
	}
	used := cpuTime() - start
	b.StopTimer()
	cancel()
	<-done
	b.ReportMetric(float64(used.Nanoseconds())/float64(ext.n.Load()), "cpu-ns/renewal")
	b.ReportMetric(float64(peak), "goroutines")
	b.ReportMetric(0, "ns/op")
}

// TestRenewedReportsTheLeasesRenewed: Renewed is told how many leases each
// renewal call extended, which leaves out an entry the adapter refused (its
// delivery lost). The runtime counts its custody.lease.extensions from it.
func TestRenewedReportsTheLeasesRenewed(t *testing.T) {
	now := time.Now()
	kept1, kept2, refused := &adapters.Delivery{ReceivedAt: now}, &adapters.Delivery{ReceivedAt: now}, &adapters.Delivery{ReceivedAt: now}
	rec := &recorder{fail: func(d *adapters.Delivery) error {
		if d == refused {
			return adapters.ErrLeaseLost
		}
		return nil
	}}
	var renewed atomic.Int64
	k := start(t, rec, Config{Lease: 300 * time.Millisecond, Renewed: func(n int) { renewed.Add(int64(n)) }})
	l1, l2 := k.Track(kept1), k.Track(kept2)
	k.Track(refused)
	eventually(t, "two renewals of each kept lease", func() bool { return rec.count(kept1) >= 2 && rec.count(kept2) >= 2 })
	l1.Stop() // no renewal is on the wire once they return
	l2.Stop()
	if refused.Signal.LostCause() == nil {
		t.Fatal("the refused delivery was not lost")
	}
	want := int64(rec.count(kept1) + rec.count(kept2))
	// Renewed runs after its call's leases are let go, so maybe after Stop.
	eventually(t, "Renewed to report every renewal", func() bool { return renewed.Load() >= want })
	if n := renewed.Load(); n != want {
		t.Fatalf("Renewed reported %d renewals, want %d: the refused entry is no renewal", n, want)
	}
}

// TestLeasesDueSoonJoinTheBatchDueNow: leases that fall due within a quarter
// of the renewal interval of one due now are renewed in the same call,
// rather than in a call each a few milliseconds apart (SQS bills each).
func TestLeasesDueSoonJoinTheBatchDueNow(t *testing.T) {
	rec := &recorder{}
	// Renewed every 100 ms; the second lease falls due 10 ms after the first.
	k := start(t, rec, Config{Lease: 300 * time.Millisecond})
	now := time.Now()
	first, second := &adapters.Delivery{ReceivedAt: now.Add(-10 * time.Millisecond)}, &adapters.Delivery{ReceivedAt: now}
	k.Track(first)
	k.Track(second)
	eventually(t, "a first renewal", func() bool { return rec.count(first) >= 1 })
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if got := len(rec.calls[0]); got != 2 {
		t.Fatalf("the first renewal call carried %d leases, want both", got)
	}
}
