package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
)

func msg(id string, body string) *consumer.Message {
	return &consumer.Message{ID: id, Body: []byte(body), Attempt: 1, Partition: -1, Offset: -1}
}

func newGuard(t testing.TB, store idempotency.Store, h consumer.HandlerFunc, opts ...idempotency.Option) consumer.Handler {
	t.Helper()
	mw, err := idempotency.New(store, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return consumer.Chain(h, mw)
}

func TestSequentialDuplicateSkipsTheHandler(t *testing.T) {
	m := newMeter(t)
	var runs atomic.Int32
	h := newGuard(t, newMemory(t), func(context.Context, *consumer.Message) error {
		runs.Add(1)
		return nil
	}, idempotency.WithMeterProvider(m))
	ctx := context.Background()
	for i := range 3 {
		if err := h.Handle(ctx, msg("m-1", "x")); err != nil {
			t.Fatalf("delivery %d: %v", i+1, err)
		}
	}
	if err := h.Handle(ctx, msg("m-2", "x")); err != nil {
		t.Fatal(err)
	}
	if runs.Load() != 2 {
		t.Fatalf("handler ran %d times for 2 distinct keys delivered 4 times, want 2", runs.Load())
	}
	if got := m.sequential(t); got != 2 {
		t.Fatalf("sequential duplicates = %d, want 2", got)
	}
	if got := m.overlapping(t); got != 0 {
		t.Fatalf("overlapping duplicates = %d, want 0", got)
	}
}

func TestOverlappingDuplicateIsRetriedLaterNotRun(t *testing.T) {
	m := newMeter(t)
	entered, leave := make(chan struct{}), make(chan struct{})
	var runs atomic.Int32
	h := newGuard(t, newMemory(t), func(context.Context, *consumer.Message) error {
		runs.Add(1)
		close(entered)
		<-leave
		return nil
	}, idempotency.WithMeterProvider(m), idempotency.WithOverlapRetryDelay(7*time.Second))
	ctx := context.Background()
	first := make(chan error, 1)
	go func() { first <- h.Handle(ctx, msg("m", "x")) }()
	<-entered

	err := h.Handle(ctx, msg("m", "x"))
	if !errors.Is(err, idempotency.ErrInProgressElsewhere) {
		t.Fatalf("overlapping delivery returned %v, want ErrInProgressElsewhere", err)
	}
	if consumer.IsPermanent(err) || !consumer.IsDeferred(err) || func() bool { d, ok := consumer.RetryDelay(err); return !ok || d != 7*time.Second }() {
		t.Fatalf("overlapping delivery returned %q, want consumer.Defer(_, 7s)", err)
	}
	close(leave)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if err := h.Handle(ctx, msg("m", "x")); err != nil {
		t.Fatalf("delivery after completion: %v", err)
	}
	if runs.Load() != 1 || m.overlapping(t) != 1 || m.sequential(t) != 1 {
		t.Fatalf("runs %d, overlapping %d, sequential %d; want 1, 1, 1", runs.Load(), m.overlapping(t), m.sequential(t))
	}
}

func TestFailedHandlerReleasesTheKey(t *testing.T) {
	m := newMeter(t)
	var runs atomic.Int32
	boom := errors.New("boom")
	h := newGuard(t, newMemory(t), func(context.Context, *consumer.Message) error {
		if runs.Add(1) == 1 {
			return boom
		}
		return nil
	}, idempotency.WithMeterProvider(m))
	ctx := context.Background()
	if err := h.Handle(ctx, msg("m", "x")); !errors.Is(err, boom) {
		t.Fatalf("first delivery = %v, want the handler's error", err)
	}
	if err := h.Handle(ctx, msg("m", "x")); err != nil {
		t.Fatalf("retry = %v, want the handler to run and succeed", err)
	}
	if runs.Load() != 2 || m.overlapping(t) != 0 {
		t.Fatalf("runs %d, overlapping %d; want 2 and 0 (the failed claim was released)", runs.Load(), m.overlapping(t))
	}
}

func TestPanickingHandlerReleasesTheKeyAndStillPanics(t *testing.T) {
	store := &faultyStore{Store: newMemory(t)}
	var runs atomic.Int32
	h := newGuard(t, store, func(context.Context, *consumer.Message) error {
		if runs.Add(1) == 1 {
			panic("handler bug")
		}
		return nil
	})
	func() {
		defer func() {
			if r := recover(); r != "handler bug" {
				t.Fatalf("recovered %v, want the handler's panic passed through", r)
			}
		}()
		_ = h.Handle(context.Background(), msg("m", "x"))
	}()
	if store.releases.Load() != 1 {
		t.Fatalf("releases = %d after a panic, want 1", store.releases.Load())
	}
	if err := h.Handle(context.Background(), msg("m", "x")); err != nil || runs.Load() != 2 {
		t.Fatalf("retry after panic = %v with %d runs; want the handler to run again", err, runs.Load())
	}
}

func TestMessageWithoutKeyIsPermanentError(t *testing.T) {
	m := newMeter(t)
	var runs atomic.Int32
	h := newGuard(t, newMemory(t), func(context.Context, *consumer.Message) error {
		runs.Add(1)
		return nil
	}, idempotency.WithMeterProvider(m))
	err := h.Handle(context.Background(), msg("", "x"))
	if !consumer.IsPermanent(err) || !errors.Is(err, idempotency.ErrNoKey) {
		t.Fatalf("keyless message = %v, want a permanent ErrNoKey", err)
	}
	if runs.Load() != 0 || m.count(t, idempotency.MetricMissingKeys, "", "") != 1 {
		t.Fatalf("runs %d, missing keys counted %d; want 0 and 1", runs.Load(), m.count(t, idempotency.MetricMissingKeys, "", ""))
	}
}

func TestKeyFuncChoosesTheKey(t *testing.T) {
	var runs atomic.Int32
	h := newGuard(t, newMemory(t), func(context.Context, *consumer.Message) error {
		runs.Add(1)
		return nil
	}, idempotency.WithKeyFunc(func(m *consumer.Message) string { return m.Headers["order"] }))
	a, b := msg("broker-1", "x"), msg("broker-2", "x")
	a.Headers = map[string]string{"order": "o-7"}
	b.Headers = map[string]string{"order": "o-7"}
	for _, m := range []*consumer.Message{a, b} {
		if err := h.Handle(context.Background(), m); err != nil {
			t.Fatal(err)
		}
	}
	if runs.Load() != 1 {
		t.Fatalf("two messages with one business key ran %d times, want 1", runs.Load())
	}
}

func TestFingerprintMismatchIsPermanentError(t *testing.T) {
	m := newMeter(t)
	var runs atomic.Int32
	h := newGuard(t, newMemory(t), func(context.Context, *consumer.Message) error {
		runs.Add(1)
		return nil
	}, idempotency.WithMeterProvider(m), idempotency.WithFingerprint(idempotency.FingerprintBody))
	ctx := context.Background()
	if err := h.Handle(ctx, msg("k", "pay 10")); err != nil {
		t.Fatal(err)
	}
	if err := h.Handle(ctx, msg("k", "pay 10")); err != nil {
		t.Fatalf("same key, same payload = %v, want a skipped duplicate", err)
	}
	err := h.Handle(ctx, msg("k", "pay 99"))
	if !consumer.IsPermanent(err) || !errors.Is(err, idempotency.ErrFingerprintMismatch) {
		t.Fatalf("same key, other payload = %v, want a permanent ErrFingerprintMismatch", err)
	}
	if runs.Load() != 1 || m.count(t, idempotency.MetricFingerprintMismatches, "", "") != 1 || m.sequential(t) != 1 {
		t.Fatalf("runs %d, mismatches %d, sequential %d; want 1, 1, 1", runs.Load(),
			m.count(t, idempotency.MetricFingerprintMismatches, "", ""), m.sequential(t))
	}
}

func TestClaimIsExtendedWhileTheHandlerRuns(t *testing.T) {
	const lease = 400 * time.Millisecond
	store := &faultyStore{Store: newMemory(t)}
	entered, leave := make(chan struct{}), make(chan struct{})
	h := newGuard(t, store, func(context.Context, *consumer.Message) error {
		close(entered)
		<-leave
		return nil
	}, idempotency.WithLease(lease), idempotency.WithExtendInterval(lease/8))
	ctx := context.Background()
	first := make(chan error, 1)
	go func() { first <- h.Handle(ctx, msg("m", "x")) }()
	<-entered

	// Three leases later the claim would have run out without extension.
	time.Sleep(3 * lease)
	if err := h.Handle(ctx, msg("m", "x")); !errors.Is(err, idempotency.ErrInProgressElsewhere) {
		t.Fatalf("duplicate three leases into a running handler = %v, want in progress elsewhere (the claim must be extended)", err)
	}
	close(leave)
	if err := <-first; err != nil {
		t.Fatal(err)
	}

	// Extensions end with the handler.
	n := store.extends.Load()
	if n == 0 {
		t.Fatal("the claim was never extended")
	}
	time.Sleep(lease)
	if store.extends.Load() != n {
		t.Fatalf("Extend was called %d more times after the handler returned", store.extends.Load()-n)
	}
}

func TestNoExtensionRunsOnceTheHandlerReturned(t *testing.T) {
	store := &faultyStore{Store: newMemory(t)}
	store.extendHangs.Store(true) // an Extend stuck on a slow store
	h := newGuard(t, store, func(context.Context, *consumer.Message) error {
		eventually(t, "an extension is on the wire", func() bool { return store.extending.Load() == 1 })
		return nil
	}, idempotency.WithLease(time.Hour), idempotency.WithExtendInterval(5*time.Millisecond))
	if err := h.Handle(context.Background(), msg("m", "x")); err != nil {
		t.Fatal(err)
	}
	if n := store.extending.Load(); n != 0 {
		t.Fatalf("%d extensions still running after Handle returned; they must end before the key is completed", n)
	}
	if st, _, _ := store.Claim(context.Background(), "m", "", time.Minute); st != idempotency.Completed {
		t.Fatalf("key = %v, want completed", st)
	}
}

func TestLostClaimCancelsTheHandler(t *testing.T) {
	m := newMeter(t)
	store := &faultyStore{Store: newMemory(t)}
	stale := error(idempotency.ErrStaleToken)
	store.extendErr.Store(&stale)
	var cause error
	h := newGuard(t, store, func(ctx context.Context, _ *consumer.Message) error {
		select {
		case <-ctx.Done():
		case <-time.After(30 * time.Second):
			return errors.New("the handler was never told that its claim was lost")
		}
		cause = context.Cause(ctx)
		return ctx.Err()
	},
		// The claim would hold for an hour: the handler is cancelled because
		// the store said the claim is gone, not because the lease ran out.
		idempotency.WithMeterProvider(m), idempotency.WithLease(time.Hour), idempotency.WithExtendInterval(10*time.Millisecond))
	err := h.Handle(context.Background(), msg("m", "x"))
	if !errors.Is(err, context.Canceled) || !errors.Is(cause, idempotency.ErrClaimLost) {
		t.Fatalf("handler returned %v with cause %v; want its context cancelled with ErrClaimLost", err, cause)
	}
	// The middleware stopped the handler, not the message's fault: the
	// message waits and is tried again without using up an attempt.
	if !consumer.IsUnavailable(err) || !errors.Is(err, idempotency.ErrClaimLost) {
		t.Fatalf("Handle = %v, want an unavailable error wrapping ErrClaimLost", err)
	}
	if got := m.count(t, idempotency.MetricClaimsLost, "custody.idempotency.op", "extend"); got != 1 {
		t.Fatalf("claims lost = %d, want 1", got)
	}
	// A stale token is an answer, not a failure: it is not retried as one.
	if got := m.count(t, idempotency.MetricStoreErrors, "custody.idempotency.op", "extend"); got != 0 {
		t.Fatalf("store errors (extend) = %d, want 0", got)
	}
	if n := store.extends.Load(); n != 1 {
		t.Fatalf("%d extension attempts, want 1: the claim is known lost after the first", n)
	}
}

// A handler that gives a permanent verdict on its message keeps it, even
// when its claim was lost meanwhile: a message that cannot be parsed is not
// made to wait for ever.
func TestPermanentErrorStandsWhenTheClaimWasLost(t *testing.T) {
	store := &faultyStore{Store: newMemory(t)}
	stale := error(idempotency.ErrStaleToken)
	store.extendErr.Store(&stale)
	bad := errors.New("cannot parse")
	h := newGuard(t, store, func(ctx context.Context, _ *consumer.Message) error {
		<-ctx.Done()
		return consumer.Permanent(bad)
	}, idempotency.WithLease(time.Hour), idempotency.WithExtendInterval(10*time.Millisecond))
	err := h.Handle(context.Background(), msg("m", "x"))
	if !consumer.IsPermanent(err) || consumer.IsUnavailable(err) || !errors.Is(err, bad) {
		t.Fatalf("Handle = %v, want the handler's permanent error as it was", err)
	}
}

// An overlapping duplicate is tried again a lease later unless
// WithOverlapRetryDelay says otherwise, as documented: by then the original
// has finished or its claim has run out.
func TestOverlapRetryDelayDefaultsToTheLease(t *testing.T) {
	for _, lease := range []time.Duration{0, 7 * time.Second} {
		store := newMemory(t)
		var opts []idempotency.Option
		want := idempotency.DefaultLease
		if lease != 0 {
			opts, want = append(opts, idempotency.WithLease(lease)), lease
		}
		h := newGuard(t, store, func(context.Context, *consumer.Message) error {
			t.Error("the handler ran for a key in progress elsewhere")
			return nil
		}, opts...)
		if _, _, err := store.Claim(context.Background(), "m", "", time.Hour); err != nil {
			t.Fatal(err)
		}
		err := h.Handle(context.Background(), msg("m", "x"))
		if d, ok := consumer.RetryDelay(err); !errors.Is(err, idempotency.ErrInProgressElsewhere) || !ok || d != want {
			t.Errorf("lease %v: overlapping duplicate = %v (retry after %v), want Defer(ErrInProgressElsewhere, %v)", lease, err, d, want)
		}
	}
}

// The defaults: a claim of DefaultLease, extended every fifth of the lease,
// so that a running handler outlives a store outage of three fifths of it.
func TestDefaultLeaseAndExtendInterval(t *testing.T) {
	store := &leaseStore{Store: newMemory(t)}
	h := newGuard(t, store, func(context.Context, *consumer.Message) error { return nil })
	if err := h.Handle(context.Background(), msg("m", "x")); err != nil {
		t.Fatal(err)
	}
	if got := store.leases(); len(got) != 1 || got[0] != 10*time.Second {
		t.Fatalf("claimed with leases %v, want one of 10s (DefaultLease)", got)
	}

	const lease = time.Second
	store = &leaseStore{Store: newMemory(t)}
	h = newGuard(t, store, func(ctx context.Context, _ *consumer.Message) error {
		eventually(t, "the claim is extended", func() bool { return store.extended() })
		return nil
	}, idempotency.WithLease(lease))
	if err := h.Handle(context.Background(), msg("m", "x")); err != nil {
		t.Fatal(err)
	}
	// An extension may wait for the store until the next is due, so its
	// deadline is at most one interval after it starts.
	if w := store.firstExtendWait(); w <= 0 || w > lease/5 {
		t.Fatalf("the first extension was given %v, want at most a fifth of the %v lease: the default interval", w, lease)
	}
}

// leaseStore records the leases claims ask for, and how long the first
// Extend was given.
type leaseStore struct {
	idempotency.Store
	mu     sync.Mutex
	asked  []time.Duration
	wait   time.Duration
	extend bool
}

func (s *leaseStore) Claim(ctx context.Context, key, fp string, lease time.Duration) (idempotency.State, idempotency.Token, error) {
	s.mu.Lock()
	s.asked = append(s.asked, lease)
	s.mu.Unlock()
	return s.Store.Claim(ctx, key, fp, lease)
}

func (s *leaseStore) Extend(ctx context.Context, key string, tok idempotency.Token, lease time.Duration) error {
	entered := time.Now()
	s.mu.Lock()
	if d, ok := ctx.Deadline(); ok && !s.extend {
		s.wait = d.Sub(entered)
	}
	s.extend = true
	s.mu.Unlock()
	return s.Store.Extend(ctx, key, tok, lease)
}

func (s *leaseStore) leases() []time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]time.Duration(nil), s.asked...)
}

func (s *leaseStore) extended() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.extend
}

func (s *leaseStore) firstExtendWait() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.wait
}

// A claim lost while the handler ran is counted once, even when the
// handler finishes regardless and recording its effect then fails for the
// same reason.
func TestLostClaimIsCountedOnceWhenTheHandlerFinishesAnyway(t *testing.T) {
	m := newMeter(t)
	store := &faultyStore{Store: newMemory(t)}
	stale := error(idempotency.ErrStaleToken)
	store.extendErr.Store(&stale)
	store.completeErr.Store(&stale)
	h := newGuard(t, store, func(ctx context.Context, _ *consumer.Message) error {
		<-ctx.Done()
		return nil // the effect was done regardless
	}, idempotency.WithMeterProvider(m), idempotency.WithLease(time.Second), idempotency.WithExtendInterval(10*time.Millisecond))
	if err := h.Handle(context.Background(), msg("m", "x")); err != nil {
		t.Fatal(err)
	}
	extend := m.count(t, idempotency.MetricClaimsLost, "custody.idempotency.op", "extend")
	complete := m.count(t, idempotency.MetricClaimsLost, "custody.idempotency.op", "complete")
	if extend+complete != 1 {
		t.Fatalf("claims lost = %d (extend) + %d (complete), want one loss counted once", extend, complete)
	}
}

func TestFailingExtensionsCancelTheHandlerBeforeTheClaimRunsOut(t *testing.T) {
	m := newMeter(t)
	store := &faultyStore{Store: newMemory(t)}
	down := errors.New("store unreachable")
	store.extendErr.Store(&down)
	h := newGuard(t, store, func(ctx context.Context, _ *consumer.Message) error {
		select {
		case <-ctx.Done():
		case <-time.After(30 * time.Second):
			return errors.New("the handler was never told that its claim could not be kept")
		}
		if !errors.Is(context.Cause(ctx), idempotency.ErrClaimLost) {
			return fmt.Errorf("cause = %v, want ErrClaimLost", context.Cause(ctx))
		}
		return nil
	}, idempotency.WithMeterProvider(m),
		// The first extension is due at a fifth of the lease and retried
		// while the next is due before the claim runs out: the lease
		// leaves a late timer (a loaded machine) room. With 300 ms, one
		// 100 ms late once left no time for the retry the test asks for.
		idempotency.WithLease(1500*time.Millisecond))
	if err := h.Handle(context.Background(), msg("m", "x")); err != nil {
		t.Fatal(err)
	}
	if store.extends.Load() < 2 {
		t.Fatalf("%d extension attempts; a transient failure must be retried once before giving up", store.extends.Load())
	}
	if m.count(t, idempotency.MetricStoreErrors, "custody.idempotency.op", "extend") < 1 ||
		m.count(t, idempotency.MetricClaimsLost, "custody.idempotency.op", "extend") != 1 {
		t.Fatal("failed extensions and the lost claim were not counted")
	}
}

func TestFailedCompleteStillAcks(t *testing.T) {
	m := newMeter(t)
	store := &faultyStore{Store: newMemory(t)}
	down := errors.New("store unreachable")
	store.completeErr.Store(&down)
	h := newGuard(t, store, func(context.Context, *consumer.Message) error { return nil },
		idempotency.WithMeterProvider(m))
	if err := h.Handle(context.Background(), msg("m", "x")); err != nil {
		t.Fatalf("Handle = %v after the effect succeeded; a failed Complete must not make the runtime run the effect again", err)
	}
	if got := m.count(t, idempotency.MetricStoreErrors, "custody.idempotency.op", "complete"); got != 1 {
		t.Fatalf("complete errors counted %d, want 1", got)
	}
}

// A Complete that fails once (a dropped connection) is tried again, so the
// key is recorded completed: a duplicate delivered later is a sequential
// duplicate, skipped, rather than a second run of the effect once the claim
// runs out.
func TestFailedCompleteIsTriedAgain(t *testing.T) {
	m := newMeter(t)
	store := &faultyStore{Store: newMemory(t)}
	dropped := errors.New("connection reset by peer")
	store.completeErrOnce.Store(&dropped)
	h := newGuard(t, store, func(context.Context, *consumer.Message) error { return nil },
		idempotency.WithMeterProvider(m), idempotency.WithLogger(quiet))
	if err := h.Handle(context.Background(), msg("m", "x")); err != nil {
		t.Fatal(err)
	}
	if got := store.completes.Load(); got != 2 {
		t.Errorf("%d Complete calls, want 2: the failed one tried once more", got)
	}
	if st, _, _ := store.Claim(context.Background(), "m", "", time.Minute); st != idempotency.Completed {
		t.Fatalf("key = %v after a Complete failed once, want completed", st)
	}
	if got := m.count(t, idempotency.MetricStoreErrors, "custody.idempotency.op", "complete"); got != 0 {
		t.Errorf("complete errors counted %d, want 0: the retry recorded the effect", got)
	}
}

func TestCompletionSurvivesCancelledHandlerContext(t *testing.T) {
	store := newMemory(t)
	ctx, cancel := context.WithCancel(context.Background())
	h := newGuard(t, store, func(context.Context, *consumer.Message) error {
		cancel() // e.g. the shutdown deadline passed just as the effect finished
		return nil
	})
	if err := h.Handle(ctx, msg("m", "x")); err != nil {
		t.Fatal(err)
	}
	if st, _, _ := store.Claim(context.Background(), "m", "", time.Minute); st != idempotency.Completed {
		t.Fatalf("key = %v after the handler succeeded under a cancelled context, want completed", st)
	}
}

func TestInvalidOptionsFailNamingTheOption(t *testing.T) {
	store := newMemory(t)
	cases := map[string]idempotency.Option{
		"WithKeyFunc":           idempotency.WithKeyFunc(nil),
		"WithFingerprint":       idempotency.WithFingerprint(nil),
		"WithLease":             idempotency.WithLease(0),
		"WithExtendInterval":    idempotency.WithExtendInterval(-1),
		"WithRetention":         idempotency.WithRetention(0),
		"WithOverlapRetryDelay": idempotency.WithOverlapRetryDelay(0),
		"WithStoreTimeout":      idempotency.WithStoreTimeout(0),
		"WithMeterProvider":     idempotency.WithMeterProvider(nil),
		"WithLogger":            idempotency.WithLogger(nil),
	}
	for name, opt := range cases {
		if _, err := idempotency.New(store, opt); err == nil || !contains(err.Error(), name) {
			t.Errorf("New with an invalid %s = %v, want an error naming it", name, err)
		}
	}
	_, err := idempotency.New(store, idempotency.WithLease(time.Second), idempotency.WithExtendInterval(time.Second))
	if err == nil || !contains(err.Error(), "WithExtendInterval") {
		t.Errorf("extend interval equal to the lease = %v, want an error naming WithExtendInterval", err)
	}
	if _, err := idempotency.New(nil); err == nil {
		t.Error("New(nil) succeeded")
	}
	func() {
		defer func() {
			if recover() == nil {
				t.Error("Middleware with an invalid option did not panic")
			}
		}()
		idempotency.Middleware(store, idempotency.WithLease(0))
	}()
}

// refusingStore refuses every key, as PostgreSQL does a key that is not
// valid UTF-8.
type refusingStore struct{ idempotency.Store }

func (refusingStore) Claim(context.Context, string, string, time.Duration) (idempotency.State, idempotency.Token, error) {
	return 0, "", fmt.Errorf("store: %w: not valid UTF-8", idempotency.ErrUnstorableKey)
}

// A key the store cannot hold fails the message permanently, without
// running the handler: retrying would fail the same way every time.
func TestUnstorableKeyIsPermanent(t *testing.T) {
	h := newGuard(t, refusingStore{newMemory(t)}, func(context.Context, *consumer.Message) error {
		t.Error("the handler ran without a claim")
		return nil
	})
	err := h.Handle(context.Background(), msg("bin\xff", "x"))
	if !consumer.IsPermanent(err) || !errors.Is(err, idempotency.ErrUnstorableKey) {
		t.Fatalf("Handle = %v, want a permanent ErrUnstorableKey", err)
	}
}
