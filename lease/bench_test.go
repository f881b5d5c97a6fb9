package lease

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// BenchmarkStartStop measures the hot path of the consumer runtime: a
// received batch of 10 deliveries tracked with StartAll, and each lease
// stopped once its (no-op) handler finished. tracked leases stay held the
// whole time, in a ring of batches: every round stops the oldest batch and
// starts a new one in its place, so the keeper always holds that many and
// stops the leases it has held longest, as a runtime with that many
// messages in flight does. Leases are long: no renewal runs meanwhile, but
// Run does, so a wake-up of the scheduler is paid for. ns/op and allocs/op
// are per lease (one StartAll of it and one Stop). The loop reads no clock
// per batch (a clock read costs as much as a Stop): deliveries get a
// receipt time refreshed every 64 batches. A CPU profile splits the cost
// between StartAll and Stop.
func BenchmarkStartStop(b *testing.B) {
	const batch = 10
	for _, tracked := range []int{20, 100_000} {
		b.Run(fmt.Sprintf("tracked=%d", tracked), func(b *testing.B) {
			k, err := New(&nopExtender{}, Config{Lease: time.Hour})
			if err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { k.Run(ctx); close(done) }()
			defer func() { cancel(); <-done }()

			type slot struct {
				ds     []*adapters.Delivery
				leases []Lease
			}
			ring := make([]slot, tracked/batch)
			now := time.Now()
			startBatch := func(s *slot) {
				for _, d := range s.ds {
					d.ReceivedAt = now
				}
				k.StartAll(func(yield func(*Lease, *adapters.Delivery) bool) {
					for i, d := range s.ds {
						if !yield(&s.leases[i], d) {
							return
						}
					}
				})
			}
			for i := range ring {
				s := &ring[i]
				s.leases = make([]Lease, batch)
				for range batch {
					s.ds = append(s.ds, &adapters.Delivery{ID: "d"})
				}
				startBatch(s)
			}
			if n := k.Len(); n != tracked {
				b.Fatalf("Len() = %d, want %d", n, tracked)
			}
			b.ReportAllocs()
			b.ResetTimer()
			next := 0
			for n, round := 0, 0; n < b.N; n, round = n+batch, round+1 {
				if round%64 == 63 {
					now = time.Now()
				}
				s := &ring[next]
				next = (next + 1) % len(ring)
				for i := range s.leases {
					s.leases[i].Stop()
				}
				startBatch(s)
			}
			b.StopTimer()
			if n := k.Len(); n != tracked {
				b.Fatalf("Len() = %d after the run, want %d", n, tracked)
			}
		})
	}
}
