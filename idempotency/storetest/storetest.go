// Package storetest is the behavioural contract every idempotency.Store must
// pass. Store implementations run it from their tests:
//
//	func TestContract(t *testing.T) {
//		storetest.Run(t, func(t *testing.T) idempotency.Store { return newStore(t) })
//	}
//
// A store that is also an idempotency.BatchStore runs RunBatch as well.
//
// Every subtest uses keys of its own, so newStore may return the same store
// each time. Leases and retentions in the suite are short (tens to hundreds
// of milliseconds) so expiry is exercised quickly; stores must honour
// millisecond precision. No assertion depends on the machine being fast:
// waits for an expiry poll with a generous deadline, and an assertion that a
// claim is still held is only made when its lease is far longer than the
// test.
//
// BenchmarkClaimComplete and BenchmarkClaimCompleteParallel measure a store
// the same way for every implementation.
package storetest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/idempotency"
)

const (
	long     = time.Hour // a lease no test outlives
	short    = 80 * time.Millisecond
	deadline = 20 * time.Second // how long to wait for an expiry to show
)

var seq atomic.Uint64

// Key returns a key unique to this test run, for stores shared across tests.
func Key(t testing.TB) string {
	return fmt.Sprintf("%s/%d/%d", t.Name(), time.Now().UnixNano(), seq.Add(1))
}

// Run runs the contract suite against the stores newStore returns.
func Run(t *testing.T, newStore func(t *testing.T) idempotency.Store) {
	runTests(t, newStore, []test[idempotency.Store]{
		{"ClaimOfAbsentKeyIsAcquired", testClaimAbsent},
		{"SecondClaimIsInProgressElsewhere", testSecondClaim},
		{"CompletedKeyIsCompleted", testCompleted},
		{"ReleasedKeyCanBeClaimedAgain", testRelease},
		{"WrongTokenChangesNothing", testWrongToken},
		{"CompleteIsRepeatableReleaseAndExtendAreNot", testAfterComplete},
		{"ExpiredClaimIsTakenOverAndStaleHolderRefused", testTakeover},
		{"ExpiredClaimCannotBeCompleted", testExpiredNotCompletable},
		{"ExtendMovesExpiryFromNow", testExtend},
		{"CompletedRecordIsForgottenAfterRetention", testRetention},
		{"FingerprintMismatchIsAnError", testFingerprint},
		{"ConcurrentClaimsHaveOneWinner", testConcurrentClaims},
		{"ConcurrentTakeoversHaveOneWinner", testConcurrentTakeover},
		{"NonPositiveDurationsAreRejected", testDurations},
		{"KeysAreIndependent", testIndependent},
	})
}

// test is one subtest of a suite run against stores of type S.
type test[S any] struct {
	name string
	fn   func(t *testing.T, s S)
}

// runTests runs each test against a store newStore returns for it.
func runTests[S any](t *testing.T, newStore func(t *testing.T) S, tests []test[S]) {
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.fn(t, newStore(t))
		})
	}
}

func claim(t *testing.T, s idempotency.Store, key, fp string, lease time.Duration) (idempotency.State, idempotency.Token) {
	t.Helper()
	st, tok, err := s.Claim(context.Background(), key, fp, lease)
	if err != nil {
		t.Fatalf("Claim(%q): %v", key, err)
	}
	switch {
	case st == idempotency.Acquired && tok == "":
		t.Fatalf("Claim(%q) acquired with an empty token", key)
	case st != idempotency.Acquired && tok != "":
		t.Fatalf("Claim(%q) = %v with token %q; only Acquired carries a token", key, st, tok)
	}
	return st, tok
}

func mustState(t *testing.T, s idempotency.Store, key string, want idempotency.State) {
	t.Helper()
	if st, _ := claim(t, s, key, "", long); st != want {
		t.Fatalf("Claim(%q) = %v, want %v", key, st, want)
	}
}

func mustAcquire(t *testing.T, s idempotency.Store, key string, lease time.Duration) idempotency.Token {
	t.Helper()
	st, tok := claim(t, s, key, "", lease)
	if st != idempotency.Acquired {
		t.Fatalf("Claim(%q) = %v, want acquired", key, st)
	}
	return tok
}

func mustOK(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func mustStale(t *testing.T, what string, err error) {
	t.Helper()
	if !errors.Is(err, idempotency.ErrStaleToken) {
		t.Fatalf("%s = %v, want an error wrapping ErrStaleToken", what, err)
	}
}

// awaitAcquire claims key until it is acquired, which happens once the
// record holding it expires.
func awaitAcquire(t *testing.T, s idempotency.Store, key string, lease time.Duration) idempotency.Token {
	t.Helper()
	end := time.Now().Add(deadline)
	for {
		st, tok := claim(t, s, key, "", lease)
		if st == idempotency.Acquired {
			return tok
		}
		if time.Now().After(end) {
			t.Fatalf("Claim(%q) still %v after %v; the record never expired", key, st, deadline)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func testClaimAbsent(t *testing.T, s idempotency.Store) {
	mustAcquire(t, s, Key(t), long)
}

func testSecondClaim(t *testing.T, s idempotency.Store) {
	key := Key(t)
	mustAcquire(t, s, key, long)
	mustState(t, s, key, idempotency.InProgressElsewhere)
	mustState(t, s, key, idempotency.InProgressElsewhere)
}

func testCompleted(t *testing.T, s idempotency.Store) {
	ctx := context.Background()
	key := Key(t)
	tok := mustAcquire(t, s, key, long)
	mustOK(t, "Complete", s.Complete(ctx, key, tok, long))
	mustState(t, s, key, idempotency.Completed)
	mustState(t, s, key, idempotency.Completed)
}

func testRelease(t *testing.T, s idempotency.Store) {
	ctx := context.Background()
	key := Key(t)
	tok := mustAcquire(t, s, key, long)
	mustOK(t, "Release", s.Release(ctx, key, tok))
	tok2 := mustAcquire(t, s, key, long)
	if tok2 == tok {
		t.Fatalf("a new claim reused token %q", tok)
	}
	mustStale(t, "Release with the released token", s.Release(ctx, key, tok))
	mustStale(t, "Complete with the released token", s.Complete(ctx, key, tok, long))
	mustState(t, s, key, idempotency.InProgressElsewhere)
}

func testWrongToken(t *testing.T, s idempotency.Store) {
	ctx := context.Background()
	key := Key(t)
	tok := mustAcquire(t, s, key, long)
	wrong := idempotency.NewToken()
	mustStale(t, "Complete with a wrong token", s.Complete(ctx, key, wrong, long))
	mustStale(t, "Release with a wrong token", s.Release(ctx, key, wrong))
	mustStale(t, "Extend with a wrong token", s.Extend(ctx, key, wrong, long))
	mustState(t, s, key, idempotency.InProgressElsewhere)
	mustOK(t, "Complete with the right token after wrong ones", s.Complete(ctx, key, tok, long))
	mustState(t, s, key, idempotency.Completed)

	absent := Key(t)
	mustStale(t, "Complete of an absent key", s.Complete(ctx, absent, wrong, long))
	mustStale(t, "Release of an absent key", s.Release(ctx, absent, wrong))
	mustStale(t, "Extend of an absent key", s.Extend(ctx, absent, wrong, long))
	mustAcquire(t, s, absent, long)
}

func testAfterComplete(t *testing.T, s idempotency.Store) {
	ctx := context.Background()
	key := Key(t)
	tok := mustAcquire(t, s, key, long)
	mustOK(t, "Complete", s.Complete(ctx, key, tok, long))
	mustOK(t, "repeated Complete with the same token", s.Complete(ctx, key, tok, long))
	mustStale(t, "Release after Complete", s.Release(ctx, key, tok))
	mustStale(t, "Extend after Complete", s.Extend(ctx, key, tok, long))
	mustState(t, s, key, idempotency.Completed)
}

func testTakeover(t *testing.T, s idempotency.Store) {
	ctx := context.Background()
	key := Key(t)
	stale := mustAcquire(t, s, key, short)
	fresh := awaitAcquire(t, s, key, long)
	if fresh == stale {
		t.Fatalf("takeover reused the stale token %q", stale)
	}
	mustStale(t, "Complete by the stale holder", s.Complete(ctx, key, stale, long))
	mustStale(t, "Extend by the stale holder", s.Extend(ctx, key, stale, long))
	mustStale(t, "Release by the stale holder", s.Release(ctx, key, stale))
	mustState(t, s, key, idempotency.InProgressElsewhere)
	mustOK(t, "Extend by the new holder", s.Extend(ctx, key, fresh, long))
	mustOK(t, "Complete by the new holder", s.Complete(ctx, key, fresh, long))
	mustState(t, s, key, idempotency.Completed)
}

func testExpiredNotCompletable(t *testing.T, s idempotency.Store) {
	ctx := context.Background()
	key := Key(t)
	tok := mustAcquire(t, s, key, short)
	time.Sleep(2 * short) // only ever longer than asked: the lease has run out
	mustStale(t, "Complete after the lease ran out", s.Complete(ctx, key, tok, long))
	mustStale(t, "Extend after the lease ran out", s.Extend(ctx, key, tok, long))
	mustAcquire(t, s, key, long)
}

func testExtend(t *testing.T, s idempotency.Store) {
	ctx := context.Background()

	// Shortening: Extend sets the expiry to lease from now, so a long claim
	// extended by a short lease expires soon.
	key := Key(t)
	tok := mustAcquire(t, s, key, long)
	mustOK(t, "Extend", s.Extend(ctx, key, tok, short))
	awaitAcquire(t, s, key, long)

	// Lengthening: a short claim extended to a long lease outlives its
	// first lease. A machine too slow to extend within the short lease
	// sees the claim expire first; retry then, it proves nothing.
	for i := 0; ; i++ {
		key := Key(t)
		tok := mustAcquire(t, s, key, 500*time.Millisecond)
		err := s.Extend(ctx, key, tok, long)
		if errors.Is(err, idempotency.ErrStaleToken) && i < 5 {
			continue
		}
		if err != nil {
			t.Fatalf("Extend: %v", err)
		}
		time.Sleep(time.Second)
		mustState(t, s, key, idempotency.InProgressElsewhere)
		mustOK(t, "Complete after Extend", s.Complete(ctx, key, tok, long))
		return
	}
}

func testRetention(t *testing.T, s idempotency.Store) {
	ctx := context.Background()
	key := Key(t)
	tok := mustAcquire(t, s, key, long)
	mustOK(t, "Complete", s.Complete(ctx, key, tok, short))
	awaitAcquire(t, s, key, long)
}

func testFingerprint(t *testing.T, s idempotency.Store) {
	ctx := context.Background()
	key := Key(t)
	st, tok := claim(t, s, key, "fp-a", long)
	if st != idempotency.Acquired {
		t.Fatalf("Claim = %v, want acquired", st)
	}
	mismatch := func(when string) {
		t.Helper()
		st, tok, err := s.Claim(ctx, key, "fp-b", long)
		if !errors.Is(err, idempotency.ErrFingerprintMismatch) {
			t.Fatalf("Claim with another fingerprint %s = (%v, %q, %v), want ErrFingerprintMismatch", when, st, tok, err)
		}
	}
	mismatch("while in progress")
	if st, _ := claim(t, s, key, "fp-a", long); st != idempotency.InProgressElsewhere {
		t.Fatalf("Claim with the same fingerprint = %v, want in progress elsewhere", st)
	}
	if st, _ := claim(t, s, key, "", long); st != idempotency.InProgressElsewhere {
		t.Fatalf("Claim without fingerprint = %v, want in progress elsewhere", st)
	}
	mustOK(t, "Complete", s.Complete(ctx, key, tok, long))
	mismatch("after completion")
	if st, _ := claim(t, s, key, "fp-a", long); st != idempotency.Completed {
		t.Fatalf("Claim with the same fingerprint = %v, want completed", st)
	}

	// A record made without a fingerprint compares with nothing.
	bare := Key(t)
	mustAcquire(t, s, bare, long)
	if st, _ := claim(t, s, bare, "fp-b", long); st != idempotency.InProgressElsewhere {
		t.Fatalf("Claim with a fingerprint of a key claimed without = %v, want in progress elsewhere", st)
	}
}

func testConcurrentClaims(t *testing.T, s idempotency.Store) {
	racingClaims(t, s, Key(t))
}

func testConcurrentTakeover(t *testing.T, s idempotency.Store) {
	key := Key(t)
	mustAcquire(t, s, key, short)
	time.Sleep(2 * short) // only ever longer than asked: the claim has run out
	racingClaims(t, s, key)
}

// racingClaims claims key from 32 goroutines at once and checks that one
// acquired it and the others found it in progress.
func racingClaims(t *testing.T, s idempotency.Store, key string) {
	const n = 32
	var acquired, elsewhere atomic.Int32
	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make(chan error, n)
	for range n {
		wg.Go(func() {
			<-start
			st, _, err := s.Claim(context.Background(), key, "", long)
			switch {
			case err != nil:
				errs <- err
			case st == idempotency.Acquired:
				acquired.Add(1)
			case st == idempotency.InProgressElsewhere:
				elsewhere.Add(1)
			default:
				errs <- fmt.Errorf("unexpected state %v", st)
			}
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("concurrent Claim: %v", err)
	}
	if acquired.Load() != 1 || elsewhere.Load() != n-1 {
		t.Fatalf("%d concurrent claims: %d acquired, %d in progress elsewhere; want 1 and %d", n, acquired.Load(), elsewhere.Load(), n-1)
	}
}

func testDurations(t *testing.T, s idempotency.Store) {
	ctx := context.Background()
	key := Key(t)
	for _, lease := range []time.Duration{0, -time.Second} {
		if st, _, err := s.Claim(ctx, key, "", lease); err == nil {
			t.Fatalf("Claim with lease %v = %v, want an error", lease, st)
		}
	}
	tok := mustAcquire(t, s, key, long)
	if err := s.Extend(ctx, key, tok, 0); err == nil || errors.Is(err, idempotency.ErrStaleToken) {
		t.Fatalf("Extend with lease 0 = %v, want an error about the lease", err)
	}
	if err := s.Complete(ctx, key, tok, 0); err == nil || errors.Is(err, idempotency.ErrStaleToken) {
		t.Fatalf("Complete with retention 0 = %v, want an error about the retention", err)
	}
	mustState(t, s, key, idempotency.InProgressElsewhere)
}

func testIndependent(t *testing.T, s idempotency.Store) {
	ctx := context.Background()
	a, b := Key(t), Key(t)
	ta := mustAcquire(t, s, a, long)
	tb := mustAcquire(t, s, b, long)
	mustStale(t, "Complete of one key with another key's token", s.Complete(ctx, a, tb, long))
	mustOK(t, "Complete", s.Complete(ctx, a, ta, long))
	mustState(t, s, a, idempotency.Completed)
	mustState(t, s, b, idempotency.InProgressElsewhere)
}

// BenchmarkClaimComplete measures one Claim and one Complete of a fresh key,
// the work the middleware adds to every first delivery.
func BenchmarkClaimComplete(b *testing.B, s idempotency.Store) {
	prefix := Key(b)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		if !claimComplete(b, s, prefix+"/"+fmt.Sprint(i)) {
			return
		}
	}
}

// BenchmarkClaimCompleteParallel is BenchmarkClaimComplete from
// GOMAXPROCS×parallelism goroutines at once, for throughput under
// concurrency.
func BenchmarkClaimCompleteParallel(b *testing.B, s idempotency.Store, parallelism int) {
	prefix := Key(b)
	var n atomic.Uint64
	b.ReportAllocs()
	b.SetParallelism(parallelism)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if !claimComplete(b, s, prefix+"/"+fmt.Sprint(n.Add(1))) {
				return
			}
		}
	})
}

// claimComplete claims and completes key, and reports whether both
// succeeded.
func claimComplete(b *testing.B, s idempotency.Store, key string) bool {
	ctx := context.Background()
	st, tok, err := s.Claim(ctx, key, "", time.Minute)
	if err != nil || st != idempotency.Acquired {
		b.Errorf("Claim = %v, %v", st, err)
		return false
	}
	if err := s.Complete(ctx, key, tok, time.Minute); err != nil {
		b.Errorf("Complete: %v", err)
		return false
	}
	return true
}
