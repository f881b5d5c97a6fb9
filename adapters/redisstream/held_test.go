package redisstream

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/adapters"
)

// TestHeldEntriesTheRuntimeLostAreDropped: the runtime gives up deliveries
// whose leases it could not renew without telling the Source through a
// call, only through their Signals. The Source must not keep them for ever
// (a long run would grow without bound): once what it holds doubles, it
// drops those whose Signal says they are lost. Those acked or given back it
// drops at once.
func TestHeldEntriesTheRuntimeLostAreDropped(t *testing.T) {
	const n = 3 * minSweep
	e := newEnv(t)
	pipe := e.client.Pipeline()
	for range n {
		pipe.XAdd(e.ctx(), &redis.XAddArgs{Stream: e.stream, Values: []string{DefaultBodyField, "x"}})
	}
	if _, err := pipe.Exec(e.ctx()); err != nil {
		t.Fatal(err)
	}
	src := e.open()
	defer src.Close()
	var kept []*adapters.Delivery
	for got := 0; got < n; {
		ds, err := src.Receive(context.Background(), 256)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range ds {
			if got%100 == 0 {
				kept = append(kept, d)
			} else {
				d.Signal.Lose(nil)
			}
			got++
		}
	}
	src.mu.Lock()
	size := len(src.held)
	src.mu.Unlock()
	if size > minSweep+256 {
		t.Errorf("the Source tracks %d held entries after the runtime lost all but %d of %d", size, len(kept), n)
	}
	half := len(kept) / 2
	if err := src.Ack(e.ctx(), kept[:half]); err != nil {
		t.Fatal(err)
	}
	if err := src.Nack(e.ctx(), adapters.NackAll(kept[half:], 0)); err != nil {
		t.Fatal(err)
	}
	src.mu.Lock()
	defer src.mu.Unlock()
	for _, d := range kept {
		if _, ok := src.held[heldOf(d)]; ok {
			t.Fatalf("entry %s is still tracked as held after it was acked or given back", d.ID)
		}
	}
}
