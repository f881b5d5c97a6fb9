package storetest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/idempotency"
)

// RunBatch runs the contract suite of the BatchStore methods against the
// stores newStore returns: each entry of a batch call ends as the Store
// method of the same name would have it, whatever the other entries of the
// call. Run the Store suite (Run) as well.
func RunBatch(t *testing.T, newStore func(t *testing.T) idempotency.BatchStore) {
	runTests(t, newStore, []test[idempotency.BatchStore]{
		{"ClaimBatchAnswersEachKeyAsClaim", testClaimBatch},
		{"CompleteReleaseExtendBatchTakeEachClaimAlone", testHeldBatch},
		{"ExtendBatchMovesExpiryFromNow", testExtendBatch},
		{"EmptyBatchesDoNothing", testEmptyBatch},
		{"ConcurrentOverlappingBatchesHaveOneWinnerPerKey", testConcurrentBatches},
		{"FailedCallFailsEveryEntry", testFailedBatchCall},
		{"NonPositiveDurationsAreRejected", testBatchDurations},
	})
}

// keys returns n keys unique to this test run.
func keys(t testing.TB, n int) []string {
	ks := make([]string, n)
	for i := range ks {
		ks[i] = Key(t)
	}
	return ks
}

func testClaimBatch(t *testing.T, s idempotency.BatchStore) {
	ctx := context.Background()
	k := keys(t, 7)
	// k[0] absent; k[1] in progress; k[2] completed; k[3] in progress
	// and run out; k[4] completed for another payload; k[5] completed for
	// the same payload; k[6] absent, with a fingerprint.
	mustAcquire(t, s, k[1], long)
	mustOK(t, "Complete", s.Complete(ctx, k[2], mustAcquire(t, s, k[2], long), long))
	mustAcquire(t, s, k[3], short)
	for _, i := range []int{4, 5} {
		st, tok := claim(t, s, k[i], "fp-a", long)
		if st != idempotency.Acquired {
			t.Fatalf("Claim = %v, want acquired", st)
		}
		mustOK(t, "Complete", s.Complete(ctx, k[i], tok, long))
	}
	time.Sleep(2 * short) // only ever longer than asked: k[3]'s claim has run out

	res := s.ClaimBatch(ctx, []idempotency.ClaimRequest{
		{Key: k[0]}, {Key: k[1]}, {Key: k[2]}, {Key: k[3]},
		{Key: k[4], Fingerprint: "fp-b"}, {Key: k[5], Fingerprint: "fp-a"}, {Key: k[6], Fingerprint: "fp-c"},
	}, long)
	if len(res) != len(k) {
		t.Fatalf("ClaimBatch of %d keys returned %d results", len(k), len(res))
	}
	want := []idempotency.State{idempotency.Acquired, idempotency.InProgressElsewhere, idempotency.Completed, idempotency.Acquired, 0, idempotency.Completed, idempotency.Acquired}
	for i, r := range res {
		if i == 4 {
			if !errors.Is(r.Err, idempotency.ErrFingerprintMismatch) {
				t.Fatalf("ClaimBatch entry %d (another payload) = %+v, want ErrFingerprintMismatch", i, r)
			}
			continue
		}
		if r.Err != nil || r.State != want[i] || (r.State == idempotency.Acquired) != (r.Token != "") {
			t.Fatalf("ClaimBatch entry %d = %+v, want %v (and a token only when acquired)", i, r, want[i])
		}
	}
	if res[0].Token == res[3].Token || res[0].Token == res[6].Token {
		t.Fatal("ClaimBatch gave two claims one token")
	}
	mustState(t, s, k[0], idempotency.InProgressElsewhere)
	mustState(t, s, k[3], idempotency.InProgressElsewhere)
	if _, _, err := s.Claim(ctx, k[6], "fp-d", long); !errors.Is(err, idempotency.ErrFingerprintMismatch) {
		t.Fatalf("Claim of a key claimed in a batch with another fingerprint = %v, want ErrFingerprintMismatch: the batch lost the fingerprint", err)
	}
	mustOK(t, "Complete of a key claimed in a batch", s.Complete(ctx, k[0], res[0].Token, long))
	mustState(t, s, k[0], idempotency.Completed)
}

func testHeldBatch(t *testing.T, s idempotency.BatchStore) {
	ctx := context.Background()
	k := keys(t, 4)
	toks := make([]idempotency.Token, len(k))
	for i := range k {
		toks[i] = mustAcquire(t, s, k[i], long)
	}
	wrong := idempotency.NewToken()

	errs := s.CompleteBatch(ctx, []idempotency.HeldClaim{{Key: k[0], Token: toks[0]}, {Key: k[1], Token: wrong}, {Key: Key(t), Token: wrong}}, long)
	if len(errs) != 3 || errs[0] != nil {
		t.Fatalf("CompleteBatch = %v, want 3 results, the first nil", errs)
	}
	mustStale(t, "CompleteBatch entry with a wrong token", errs[1])
	mustStale(t, "CompleteBatch entry of an absent key", errs[2])
	mustState(t, s, k[0], idempotency.Completed)
	mustState(t, s, k[1], idempotency.InProgressElsewhere)
	if errs := s.CompleteBatch(ctx, []idempotency.HeldClaim{{Key: k[0], Token: toks[0]}}, long); len(errs) != 1 || errs[0] != nil {
		t.Fatalf("repeated CompleteBatch with the same token = %v, want nil", errs)
	}

	errs = s.ReleaseBatch(ctx, []idempotency.HeldClaim{{Key: k[1], Token: toks[1]}, {Key: k[2], Token: wrong}, {Key: k[0], Token: toks[0]}})
	if len(errs) != 3 || errs[0] != nil {
		t.Fatalf("ReleaseBatch = %v, want 3 results, the first nil", errs)
	}
	mustStale(t, "ReleaseBatch entry with a wrong token", errs[1])
	mustStale(t, "ReleaseBatch entry of a completed key", errs[2])
	mustAcquire(t, s, k[1], long)
	mustState(t, s, k[2], idempotency.InProgressElsewhere)
	mustState(t, s, k[0], idempotency.Completed)

	errs = s.ExtendBatch(ctx, []idempotency.HeldClaim{{Key: k[2], Token: toks[2]}, {Key: k[3], Token: wrong}, {Key: k[0], Token: toks[0]}}, long)
	if len(errs) != 3 || errs[0] != nil {
		t.Fatalf("ExtendBatch = %v, want 3 results, the first nil", errs)
	}
	mustStale(t, "ExtendBatch entry with a wrong token", errs[1])
	mustStale(t, "ExtendBatch entry of a completed key", errs[2])
	mustOK(t, "Complete of a claim another entry of a batch named with a wrong token", s.Complete(ctx, k[3], toks[3], long))
}

func testExtendBatch(t *testing.T, s idempotency.BatchStore) {
	ctx := context.Background()
	// Shortening: two long claims extended by a short lease run out soon.
	k := keys(t, 2)
	held := []idempotency.HeldClaim{{Key: k[0], Token: mustAcquire(t, s, k[0], long)}, {Key: k[1], Token: mustAcquire(t, s, k[1], long)}}
	for i, err := range s.ExtendBatch(ctx, held, short) {
		if err != nil {
			t.Fatalf("ExtendBatch entry %d: %v", i, err)
		}
	}
	awaitAcquire(t, s, k[0], long)
	awaitAcquire(t, s, k[1], long)

	// Lengthening, as in the Store suite: retry on a machine too slow to
	// extend within the short lease.
	for try := 0; ; try++ {
		k := keys(t, 2)
		held := []idempotency.HeldClaim{{Key: k[0], Token: mustAcquire(t, s, k[0], 500*time.Millisecond)}, {Key: k[1], Token: mustAcquire(t, s, k[1], 500*time.Millisecond)}}
		errs := s.ExtendBatch(ctx, held, long)
		if (errors.Is(errs[0], idempotency.ErrStaleToken) || errors.Is(errs[1], idempotency.ErrStaleToken)) && try < 5 {
			continue
		}
		for i, err := range errs {
			if err != nil {
				t.Fatalf("ExtendBatch entry %d: %v", i, err)
			}
		}
		time.Sleep(time.Second)
		mustState(t, s, k[0], idempotency.InProgressElsewhere)
		mustState(t, s, k[1], idempotency.InProgressElsewhere)
		return
	}
}

func testEmptyBatch(t *testing.T, s idempotency.BatchStore) {
	ctx := context.Background()
	if res := s.ClaimBatch(ctx, nil, long); len(res) != 0 {
		t.Fatalf("ClaimBatch of no keys = %v", res)
	}
	if errs := s.CompleteBatch(ctx, nil, long); len(errs) != 0 {
		t.Fatalf("CompleteBatch of no claims = %v", errs)
	}
	if errs := s.ReleaseBatch(ctx, nil); len(errs) != 0 {
		t.Fatalf("ReleaseBatch of no claims = %v", errs)
	}
	if errs := s.ExtendBatch(ctx, nil, long); len(errs) != 0 {
		t.Fatalf("ExtendBatch of no claims = %v", errs)
	}
}

// testConcurrentBatches claims one set of keys from 8 goroutines at once,
// each in another order: each key is acquired once, and no call fails (a
// store that takes row locks in the order given deadlocks here).
func testConcurrentBatches(t *testing.T, s idempotency.BatchStore) {
	const n, callers = 40, 8
	k := keys(t, n)
	wins := make([]int, n)
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make(chan error, callers*n)
	for range callers {
		order := rand.Perm(n)
		wg.Go(func() {
			reqs := make([]idempotency.ClaimRequest, n)
			for i, j := range order {
				reqs[i] = idempotency.ClaimRequest{Key: k[j]}
			}
			<-start
			res := s.ClaimBatch(context.Background(), reqs, long)
			mu.Lock()
			defer mu.Unlock()
			for i, r := range res {
				switch {
				case r.Err != nil:
					errs <- r.Err
				case r.State == idempotency.Acquired:
					wins[order[i]]++
				case r.State != idempotency.InProgressElsewhere:
					errs <- fmt.Errorf("unexpected state %v", r.State)
				}
			}
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("concurrent ClaimBatch: %v", err)
	}
	for i, w := range wins {
		if w != 1 {
			t.Fatalf("key %d acquired by %d of %d concurrent batches, want 1", i, w, callers)
		}
	}
}

// testFailedBatchCall: a call that cannot reach the store (here, its
// context is done) fails every entry, and none is taken for a success.
func testFailedBatchCall(t *testing.T, s idempotency.BatchStore) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	k := keys(t, 3)
	held := []idempotency.HeldClaim{{Key: k[0], Token: mustAcquire(t, s, k[0], long)}, {Key: k[1], Token: mustAcquire(t, s, k[1], long)}}
	for i, r := range s.ClaimBatch(ctx, []idempotency.ClaimRequest{{Key: k[2]}, {Key: Key(t)}}, long) {
		if r.Err == nil {
			t.Fatalf("ClaimBatch entry %d on a cancelled context = %+v, want an error", i, r)
		}
	}
	check := func(what string, errs []error) {
		t.Helper()
		if len(errs) != len(held) {
			t.Fatalf("%s returned %d results for %d claims", what, len(errs), len(held))
		}
		for i, err := range errs {
			if err == nil || errors.Is(err, idempotency.ErrStaleToken) {
				t.Fatalf("%s entry %d on a cancelled context = %v, want the call's error", what, i, err)
			}
		}
	}
	check("CompleteBatch", s.CompleteBatch(ctx, held, long))
	check("ReleaseBatch", s.ReleaseBatch(ctx, held))
	check("ExtendBatch", s.ExtendBatch(ctx, held, long))
	mustState(t, s, k[0], idempotency.InProgressElsewhere)
}

func testBatchDurations(t *testing.T, s idempotency.BatchStore) {
	ctx := context.Background()
	k := keys(t, 2)
	for _, r := range s.ClaimBatch(ctx, []idempotency.ClaimRequest{{Key: k[0]}}, 0) {
		if r.Err == nil {
			t.Fatalf("ClaimBatch with lease 0 = %+v, want an error", r)
		}
	}
	held := []idempotency.HeldClaim{{Key: k[1], Token: mustAcquire(t, s, k[1], long)}}
	for what, errs := range map[string][]error{
		"CompleteBatch with retention 0": s.CompleteBatch(ctx, held, 0),
		"ExtendBatch with lease 0":       s.ExtendBatch(ctx, held, 0),
	} {
		if len(errs) != 1 || errs[0] == nil || errors.Is(errs[0], idempotency.ErrStaleToken) {
			t.Fatalf("%s = %v, want an error about the duration", what, errs)
		}
	}
	mustAcquire(t, s, k[0], long)
	mustState(t, s, k[1], idempotency.InProgressElsewhere)
}
