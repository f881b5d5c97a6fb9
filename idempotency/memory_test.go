package idempotency_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/storetest"
)

func newMemory(t testing.TB, opts ...idempotency.MemoryOption) *idempotency.MemoryStore {
	t.Helper()
	s, err := idempotency.NewMemoryStore(opts...)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestMemoryStoreContract(t *testing.T) {
	storetest.Run(t, func(t *testing.T) idempotency.Store { return newMemory(t) })
}

func TestMemoryStoreEvictsCompletedBeforeInProgress(t *testing.T) {
	ctx := context.Background()
	s := newMemory(t, idempotency.MemoryMaxEntries(3))
	claim := func(key string) (idempotency.State, idempotency.Token, error) {
		return s.Claim(ctx, key, "", time.Hour)
	}
	_, ta, _ := claim("a")
	_, tb, _ := claim("b")
	_, _, _ = claim("c")
	if err := s.Complete(ctx, "a", ta, time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(ctx, "b", tb, 2*time.Hour); err != nil {
		t.Fatal(err)
	}
	// Full: "a" (completed, nearest expiry) makes room for "d".
	if st, _, err := claim("d"); err != nil || st != idempotency.Acquired {
		t.Fatalf("Claim(d) on a full store = %v, %v; want acquired after evicting a completed record", st, err)
	}
	if s.Evictions() != 1 || s.Len() != 3 {
		t.Fatalf("evictions %d, len %d; want 1 and 3", s.Evictions(), s.Len())
	}
	if st, _, _ := claim("b"); st != idempotency.Completed {
		t.Fatalf("b = %v, want still completed (later expiry than a)", st)
	}
	// a was evicted, so it can be claimed again; that evicts b, the last
	// completed record, and leaves only in-progress claims.
	if st, _, _ := claim("a"); st != idempotency.Acquired {
		t.Fatalf("a = %v, want acquired again (evicted)", st)
	}
	if s.Evictions() != 2 {
		t.Fatalf("evictions %d, want 2", s.Evictions())
	}
	if _, _, err := claim("f"); !errors.Is(err, idempotency.ErrMemoryStoreFull) {
		t.Fatalf("Claim on a store full of in-progress claims = %v, want ErrMemoryStoreFull", err)
	}
	if st, _, _ := claim("c"); st != idempotency.InProgressElsewhere {
		t.Fatalf("in-progress claim c = %v after evictions; in-progress claims must never be evicted", st)
	}
}

func TestMemoryStoreDropsExpiredBeforeEvicting(t *testing.T) {
	ctx := context.Background()
	s := newMemory(t, idempotency.MemoryMaxEntries(2))
	if _, _, err := s.Claim(ctx, "short", "", time.Millisecond); err != nil {
		t.Fatal(err)
	}
	_, tok, _ := s.Claim(ctx, "done", "", time.Hour)
	if err := s.Complete(ctx, "done", tok, time.Hour); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond)
	if st, _, err := s.Claim(ctx, "new", "", time.Hour); err != nil || st != idempotency.Acquired {
		t.Fatalf("Claim = %v, %v", st, err)
	}
	if s.Evictions() != 0 {
		t.Fatalf("evicted %d completed records although an expired claim could be dropped", s.Evictions())
	}
	if st, _, _ := s.Claim(ctx, "done", "", time.Hour); st != idempotency.Completed {
		t.Fatalf("done = %v, want completed", st)
	}
}

func TestMemoryMaxEntriesInvalid(t *testing.T) {
	_, err := idempotency.NewMemoryStore(idempotency.MemoryMaxEntries(0))
	if err == nil || !contains(err.Error(), "MemoryMaxEntries") {
		t.Fatalf("NewMemoryStore(MemoryMaxEntries(0)) = %v, want an error naming the option", err)
	}
}

func BenchmarkMemoryStoreClaimComplete(b *testing.B) {
	storetest.BenchmarkClaimComplete(b, newMemory(b, idempotency.MemoryMaxEntries(1<<20)))
}

func BenchmarkMemoryStoreClaimCompleteParallel(b *testing.B) {
	storetest.BenchmarkClaimCompleteParallel(b, newMemory(b, idempotency.MemoryMaxEntries(1<<20)), 8)
}

func TestMemoryStoreBatchContract(t *testing.T) {
	storetest.RunBatch(t, func(t *testing.T) idempotency.BatchStore { return newMemory(t) })
}
