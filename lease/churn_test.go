package lease

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// churnExt checks, for every delivery it is asked to extend, that its lease
// was not stopped (Stop returned) before the call.
type churnExt struct {
	stopped    sync.Map // *adapters.Delivery -> *atomic.Bool
	violations atomic.Int64
	calls      atomic.Int64
}

func (e *churnExt) Extend(ctx context.Context, ds []*adapters.Delivery, d time.Duration) error {
	e.calls.Add(1)
	var failed map[int]error
	for i, x := range ds {
		if v, ok := e.stopped.Load(x); ok && v.(*atomic.Bool).Load() {
			e.violations.Add(1)
		}
		switch rand.IntN(20) {
		case 0:
			if failed == nil {
				failed = map[int]error{}
			}
			failed[i] = adapters.ErrLeaseLost
		case 1:
			if failed == nil {
				failed = map[int]error{}
			}
			failed[i] = errors.New("transient")
		}
	}
	if rand.IntN(4) == 0 {
		time.Sleep(time.Duration(rand.IntN(200)) * time.Microsecond)
	}
	// Check again after the call: Stop must have waited for it.
	for _, x := range ds {
		if v, ok := e.stopped.Load(x); ok && v.(*atomic.Bool).Load() {
			e.violations.Add(1)
		}
	}
	if failed != nil {
		return &adapters.BatchError{Failed: failed}
	}
	return nil
}

// Under churn (leases started, stopped, some twice, slots reused; renewals
// failing now and then, for good or not; a hold cap), no delivery is
// extended once its Lease.Stop returned, the heap stays within twice the
// leases in use plus minStale, and nothing is left tracked at the end.
func TestChurnNeverExtendsAStoppedLease(t *testing.T) {
	ext := &churnExt{}
	k := start(t, ext, Config{Lease: 3 * time.Millisecond, MaxHold: 20 * time.Millisecond, MaxBatch: 7})
	var wg sync.WaitGroup
	var maxHeap atomic.Int64
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var ls [16]Lease
			var ds [16]*adapters.Delivery
			for iter := 0; iter < 3000; iter++ {
				i := rand.IntN(len(ls))
				if ds[i] != nil {
					ls[i].Stop()
					if rand.IntN(3) == 0 {
						ls[i].Stop()
					}
					v, _ := ext.stopped.Load(ds[i])
					v.(*atomic.Bool).Store(true)
					ds[i] = nil
					continue
				}
				d := &adapters.Delivery{ID: "x", ReceivedAt: time.Now().Add(-time.Duration(rand.IntN(3)) * time.Millisecond)}
				ext.stopped.Store(d, new(atomic.Bool))
				ds[i] = d
				k.Start(&ls[i], d)
				if rand.IntN(10) == 0 {
					time.Sleep(time.Millisecond)
				}
				k.mu.Lock()
				h := len(k.t.heap)
				live := k.t.live
				k.mu.Unlock()
				if int64(h) > maxHeap.Load() {
					maxHeap.Store(int64(h))
				}
				if h > 2*live+minStale+1 {
					t.Errorf("heap %d entries for %d live", h, live)
				}
			}
			for i := range ls {
				if ds[i] != nil {
					ls[i].Stop()
					v, _ := ext.stopped.Load(ds[i])
					v.(*atomic.Bool).Store(true)
				}
			}
		}()
	}
	wg.Wait()
	if n := ext.violations.Load(); n > 0 {
		t.Fatalf("%d extensions of stopped leases", n)
	}
	if n := k.Len(); n != 0 {
		t.Fatalf("Len = %d after every lease stopped", n)
	}
	k.mu.Lock()
	live := k.t.live
	k.mu.Unlock()
	if live != 0 {
		t.Fatalf("live = %d after every lease stopped", live)
	}
	t.Logf("calls %d, max heap %d", ext.calls.Load(), maxHeap.Load())
}
