package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/teststores"
)

func newBatchGuard(t testing.TB, store idempotency.Store, h consumer.BatchHandlerFunc, opts ...idempotency.Option) consumer.BatchHandler {
	t.Helper()
	mw, err := idempotency.NewBatch(store, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return consumer.ChainBatch(h, mw)
}

func slogTo(w io.Writer) *slog.Logger { return slog.New(slog.NewTextHandler(w, nil)) }

// outcome names what was recorded for m: "done", "none", or the kind of
// its error ("permanent", "unavailable", "deferred", "failed").
func outcome(b *consumer.Batch, m *consumer.Message) string {
	err, ok := b.Result(m)
	switch {
	case !ok:
		return "none"
	case err == nil:
		return "done"
	case consumer.IsPermanent(err):
		return "permanent"
	case consumer.IsUnavailable(err):
		return "unavailable"
	case consumer.IsDeferred(err):
		return "deferred"
	}
	return "failed"
}

// bodies returns the bodies of msgs.
func bodies(msgs []*consumer.Message) []string {
	var bs []string
	for _, m := range msgs {
		bs = append(bs, string(m.Body))
	}
	return bs
}

// Every message of a batch ends as it would alone under New: the acquired
// ones go to the next handler, as a batch of their own, and the outcome it
// records for each is the message's; a completed key is skipped and done,
// a key in progress elsewhere deferred, a message without a key refused.
// Afterwards the done keys are completed and the others released.
func TestBatchOutcomePerMessage(t *testing.T) {
	for _, st := range teststores.All() {
		t.Run(st.Name, func(t *testing.T) {
			ctx := context.Background()
			store := st.New(t)
			m := newMeter(t)
			// Before the batch: "old" completed, "busy" held by another
			// delivery.
			if s, tok, err := store.Claim(ctx, "old", "", time.Hour); err != nil || s != idempotency.Acquired {
				t.Fatalf("Claim: %v, %v", s, err)
			} else if err := store.Complete(ctx, "old", tok, time.Hour); err != nil {
				t.Fatal(err)
			}
			if s, _, err := store.Claim(ctx, "busy", "", time.Hour); err != nil || s != idempotency.Acquired {
				t.Fatalf("Claim: %v, %v", s, err)
			}
			var seen []string
			boom := errors.New("boom")
			h := newBatchGuard(t, store, func(_ context.Context, b *consumer.Batch) error {
				seen = bodies(b.Messages)
				for _, msg := range b.Messages {
					switch string(msg.Body) {
					case "ok":
						b.Done(msg)
					case "fails":
						b.Fail(msg, boom)
					case "poison":
						b.Fail(msg, consumer.Permanent(boom))
					} // "forgotten": no outcome
				}
				return nil
			}, idempotency.WithMeterProvider(m), idempotency.WithOverlapRetryDelay(7*time.Second))

			b := consumer.BatchOf([]*consumer.Message{
				msg("k-ok", "ok"), msg("old", "skipped"), msg("k-fails", "fails"), msg("busy", "overlaps"),
				msg("", "keyless"), msg("k-forgotten", "forgotten"), msg("k-poison", "poison"),
			})
			if err := h.HandleBatch(ctx, b); err != nil {
				t.Fatalf("HandleBatch = %v", err)
			}
			if want := []string{"ok", "fails", "forgotten", "poison"}; !slices.Equal(seen, want) {
				t.Fatalf("the next handler saw %v, want %v", seen, want)
			}
			want := []string{"done", "done", "failed", "deferred", "permanent", "none", "permanent"}
			for i, msg := range b.Messages {
				if got := outcome(b, msg); got != want[i] {
					t.Errorf("%s: outcome %q, want %q", msg.Body, got, want[i])
				}
			}
			if err, _ := b.Result(b.Messages[2]); !errors.Is(err, boom) {
				t.Errorf("outcome of the failed message %v, want the handler's error", err)
			}
			if err, _ := b.Result(b.Messages[4]); !errors.Is(err, idempotency.ErrNoKey) {
				t.Errorf("outcome of the keyless message %v, want ErrNoKey", err)
			}
			if err, _ := b.Result(b.Messages[3]); !errors.Is(err, idempotency.ErrInProgressElsewhere) || func() bool { d, _ := consumer.RetryDelay(err); return d != 7*time.Second }() {
				t.Errorf("overlapping duplicate's outcome %v, want consumer.Defer(ErrInProgressElsewhere, 7s)", err)
			}
			if m.sequential(t) != 1 || m.overlapping(t) != 1 || m.count(t, idempotency.MetricMissingKeys, "", "") != 1 {
				t.Errorf("sequential %d, overlapping %d, missing keys %d; want 1 each", m.sequential(t), m.overlapping(t), m.count(t, idempotency.MetricMissingKeys, "", ""))
			}
			// The done key is completed; the failed, forgotten and
			// poison ones are released, so that their retries run.
			for key, want := range map[string]idempotency.State{
				"k-ok": idempotency.Completed, "k-fails": idempotency.Acquired, "k-forgotten": idempotency.Acquired, "k-poison": idempotency.Acquired,
			} {
				if s, _, err := store.Claim(ctx, key, "", time.Hour); err != nil || s != want {
					t.Errorf("Claim(%q) after the batch = %v, %v; want %v", key, s, err, want)
				}
			}
		})
	}
}

// Two messages of one batch with one key are one effect: the later one is
// never passed on. It is done once the first one is; deferred as an
// overlapping duplicate when the first one failed; and refused when its
// payload differs.
func TestBatchDuplicateKeysInOneBatch(t *testing.T) {
	ctx := context.Background()
	m := newMeter(t)
	var seen [][]string
	h := newBatchGuard(t, newMemory(t), func(_ context.Context, b *consumer.Batch) error {
		seen = append(seen, bodies(b.Messages))
		for _, msg := range b.Messages {
			if string(msg.Body) == "fails" {
				b.Fail(msg, errors.New("boom"))
				continue
			}
			b.Done(msg)
		}
		return nil
	}, idempotency.WithMeterProvider(m), idempotency.WithFingerprint(func(msg *consumer.Message) string { return msg.Headers["fp"] }))

	other := msg("a", "a-other")
	other.Headers = map[string]string{"fp": "2"}
	first := msg("a", "a")
	first.Headers = map[string]string{"fp": "1"}
	b := consumer.BatchOf([]*consumer.Message{first, msg("b", "fails"), msg("a", "a-again"), msg("b", "b-again"), other})
	if err := h.HandleBatch(ctx, b); err != nil {
		t.Fatal(err)
	}
	if len(seen) != 1 || !slices.Equal(seen[0], []string{"a", "fails"}) {
		t.Fatalf("the next handler saw %v, want [[a fails]]: a key twice in one batch ran twice", seen)
	}
	for i, want := range []string{"done", "failed", "done", "deferred", "permanent"} {
		if got := outcome(b, b.Messages[i]); got != want {
			t.Errorf("%s: outcome %q, want %q", b.Messages[i].Body, got, want)
		}
	}
	if err, _ := b.Result(other); !errors.Is(err, idempotency.ErrFingerprintMismatch) {
		t.Errorf("same key, other payload, in one batch: %v, want ErrFingerprintMismatch", err)
	}
	if m.sequential(t) != 1 || m.overlapping(t) != 1 || m.count(t, idempotency.MetricFingerprintMismatches, "", "") != 1 {
		t.Errorf("sequential %d, overlapping %d, mismatches %d; want 1 each", m.sequential(t), m.overlapping(t), m.count(t, idempotency.MetricFingerprintMismatches, "", ""))
	}
}

// A whole batch that fails (an error, a panic) fails every message with it
// and releases every claim, so that the retries run the effects.
func TestBatchErrorReleasesEveryClaim(t *testing.T) {
	for _, how := range []string{"error", "panic"} {
		t.Run(how, func(t *testing.T) {
			ctx := context.Background()
			store := newMemory(t)
			boom := errors.New("bulk insert failed")
			h := newBatchGuard(t, store, func(_ context.Context, b *consumer.Batch) error {
				b.DoneAll()
				if how == "panic" {
					panic(boom)
				}
				return boom
			})
			b := consumer.BatchOf([]*consumer.Message{msg("a", "x"), msg("b", "x")})
			var err error
			func() {
				defer func() {
					if p := recover(); p != nil {
						err = p.(error)
					}
				}()
				err = h.HandleBatch(ctx, b)
			}()
			if !errors.Is(err, boom) {
				t.Fatalf("HandleBatch = %v, want the handler's error (or panic) passed on", err)
			}
			for _, key := range []string{"a", "b"} {
				if s, _, err := store.Claim(ctx, key, "", time.Hour); err != nil || s != idempotency.Acquired {
					t.Fatalf("Claim(%q) after the batch failed = %v, %v; want acquired (released)", key, s, err)
				}
			}
		})
	}
}

// counting counts the calls a store gets, by method.
type counting struct {
	idempotency.Store
	mu    sync.Mutex
	calls map[string]int
}

func (c *counting) count(method string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.calls == nil {
		c.calls = map[string]int{}
	}
	c.calls[method]++
}

func (c *counting) got(method string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls[method]
}

func (c *counting) Claim(ctx context.Context, key, fp string, lease time.Duration) (idempotency.State, idempotency.Token, error) {
	c.count("Claim")
	return c.Store.Claim(ctx, key, fp, lease)
}

func (c *counting) Complete(ctx context.Context, key string, tok idempotency.Token, retention time.Duration) error {
	c.count("Complete")
	return c.Store.Complete(ctx, key, tok, retention)
}

func (c *counting) Release(ctx context.Context, key string, tok idempotency.Token) error {
	c.count("Release")
	return c.Store.Release(ctx, key, tok)
}

func (c *counting) Extend(ctx context.Context, key string, tok idempotency.Token, lease time.Duration) error {
	c.count("Extend")
	return c.Store.Extend(ctx, key, tok, lease)
}

// countingBatch is counting for a BatchStore, whose batch calls it counts
// too.
type countingBatch struct {
	counting
	bs idempotency.BatchStore
}

func newCountingBatch(s idempotency.BatchStore) *countingBatch {
	return &countingBatch{counting: counting{Store: s}, bs: s}
}

func (c *countingBatch) ClaimBatch(ctx context.Context, claims []idempotency.ClaimRequest, lease time.Duration) []idempotency.ClaimResult {
	c.count("ClaimBatch")
	return c.bs.ClaimBatch(ctx, claims, lease)
}

func (c *countingBatch) CompleteBatch(ctx context.Context, held []idempotency.HeldClaim, retention time.Duration) []error {
	c.count("CompleteBatch")
	return c.bs.CompleteBatch(ctx, held, retention)
}

func (c *countingBatch) ReleaseBatch(ctx context.Context, held []idempotency.HeldClaim) []error {
	c.count("ReleaseBatch")
	return c.bs.ReleaseBatch(ctx, held)
}

func (c *countingBatch) ExtendBatch(ctx context.Context, held []idempotency.HeldClaim, lease time.Duration) []error {
	c.count("ExtendBatch")
	return c.bs.ExtendBatch(ctx, held, lease)
}

// A batch's keys go to a BatchStore in one call per operation, however
// many messages; a Store that is no BatchStore gets a call per key.
func TestBatchCallsTheStoreOncePerBatch(t *testing.T) {
	const n = 50
	msgs := func(prefix string) *consumer.Batch {
		ms := make([]*consumer.Message, n)
		for i := range ms {
			ms[i] = msg(fmt.Sprint(prefix, i), fmt.Sprint(i))
		}
		return consumer.BatchOf(ms)
	}
	handle := func(_ context.Context, b *consumer.Batch) error {
		for i, m := range b.Messages {
			if i%2 == 0 {
				b.Done(m)
			} else {
				b.Fail(m, errors.New("odd"))
			}
		}
		return nil
	}
	t.Run("BatchStore", func(t *testing.T) {
		store := newCountingBatch(newMemory(t))
		if err := newBatchGuard(t, store, handle).HandleBatch(context.Background(), msgs("k")); err != nil {
			t.Fatal(err)
		}
		for method, want := range map[string]int{"ClaimBatch": 1, "CompleteBatch": 1, "ReleaseBatch": 1, "Claim": 0, "Complete": 0, "Release": 0} {
			if got := store.got(method); got != want {
				t.Errorf("%s called %d times for a batch of %d, want %d", method, got, n, want)
			}
		}
	})
	t.Run("Store", func(t *testing.T) {
		store := &counting{Store: newMemory(t)}
		if err := newBatchGuard(t, store, handle).HandleBatch(context.Background(), msgs("k")); err != nil {
			t.Fatal(err)
		}
		for method, want := range map[string]int{"Claim": n, "Complete": n / 2, "Release": n / 2} {
			if got := store.got(method); got != want {
				t.Errorf("%s called %d times for a batch of %d, want %d", method, got, n, want)
			}
		}
	})
}

// The claims of a batch are kept alive while it runs, all of them in one
// store call per renewal: a duplicate delivered after the lease would have
// run out finds its key still in progress.
func TestBatchClaimsAreKeptAliveTogether(t *testing.T) {
	const lease = 300 * time.Millisecond
	store := newCountingBatch(newMemory(t))
	entered, leave := make(chan struct{}), make(chan struct{})
	h := newBatchGuard(t, store, func(_ context.Context, b *consumer.Batch) error {
		close(entered)
		<-leave
		b.DoneAll()
		return nil
	}, idempotency.WithLease(lease), idempotency.WithExtendInterval(lease/5))
	ms := []*consumer.Message{msg("a", "x"), msg("b", "x"), msg("c", "x")}
	done := make(chan error, 1)
	go func() { done <- h.HandleBatch(context.Background(), consumer.BatchOf(ms)) }()
	<-entered
	time.Sleep(3 * lease)
	dup := consumer.BatchOf([]*consumer.Message{msg("a", "x"), msg("c", "x")})
	if err := newBatchGuard(t, store, func(context.Context, *consumer.Batch) error {
		t.Error("a duplicate ran while the batch held its key")
		return nil
	}).HandleBatch(context.Background(), dup); err != nil {
		t.Fatal(err)
	}
	close(leave)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	for _, m := range dup.Messages {
		if err, _ := dup.Result(m); !errors.Is(err, idempotency.ErrInProgressElsewhere) {
			t.Fatalf("duplicate of %s during the batch: %v, want ErrInProgressElsewhere: the claim ran out under the batch", m.ID, err)
		}
	}
	if n := store.got("ExtendBatch"); n < 3 {
		t.Fatalf("%d batch renewals in three leases, want at least 3", n)
	}
	if n := store.got("Extend"); n != 0 {
		t.Fatalf("%d single-key renewals, want none: one call renews the whole batch", n)
	}
}

// A claim lost while the batch runs (the store refuses its renewal) stops
// the batch: its context is cancelled with ErrClaimLost, and its failures
// are marked unavailable (the store stopped it, not the messages), unless
// permanent.
func TestBatchClaimLostStopsTheBatch(t *testing.T) {
	store := &faultyStore{Store: newMemory(t)}
	stale := fmt.Errorf("gone: %w", idempotency.ErrStaleToken)
	store.extendErr.Store(&stale)
	m := newMeter(t)
	var cause error
	h := newBatchGuard(t, store, func(ctx context.Context, b *consumer.Batch) error {
		select {
		case <-ctx.Done():
		case <-time.After(30 * time.Second):
			return errors.New("the batch was never told that its claims could not be kept")
		}
		cause = context.Cause(ctx)
		b.Fail(b.Messages[0], ctx.Err())
		b.Fail(b.Messages[1], consumer.Permanent(errors.New("bad data")))
		return nil
	}, idempotency.WithMeterProvider(m), idempotency.WithLease(time.Second), idempotency.WithExtendInterval(50*time.Millisecond), idempotency.WithLogger(quiet))
	b := consumer.BatchOf([]*consumer.Message{msg("a", "x"), msg("b", "x")})
	if err := h.HandleBatch(context.Background(), b); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(cause, idempotency.ErrClaimLost) {
		t.Fatalf("the batch's context cause = %v, want ErrClaimLost", cause)
	}
	if err, _ := b.Result(b.Messages[0]); !consumer.IsUnavailable(err) || !errors.Is(err, context.Canceled) {
		t.Fatalf("outcome of the message the cancelled batch failed: %v, want its error marked unavailable", err)
	}
	if err, _ := b.Result(b.Messages[1]); !consumer.IsPermanent(err) || consumer.IsUnavailable(err) {
		t.Fatalf("outcome of the message failed permanently: %v, want it left permanent", err)
	}
	if n := m.count(t, idempotency.MetricClaimsLost, "custody.idempotency.op", "extend"); n != 2 {
		t.Fatalf("claims lost (extend) = %d, want 2", n)
	}
}

// A store that cannot claim the keys fails each message as unavailable,
// without running the next handler, counts each failed claim and logs the
// outage without a line per message.
func TestBatchStoreFailureIsUnavailable(t *testing.T) {
	for _, name := range []string{"BatchStore", "Store"} {
		t.Run(name, func(t *testing.T) {
			var log syncBuffer
			var store idempotency.Store = &downStore{Store: newMemory(t)}
			store.(*downStore).down.Store(true)
			if name == "BatchStore" {
				store = &downBatchStore{downStore: store.(*downStore)}
			}
			m := newMeter(t)
			h := newBatchGuard(t, store, func(context.Context, *consumer.Batch) error {
				t.Error("the next handler ran without claims")
				return nil
			}, idempotency.WithMeterProvider(m), idempotency.WithLogger(slogTo(&log)))
			const n = 20
			ms := make([]*consumer.Message, n)
			for i := range ms {
				ms[i] = msg(fmt.Sprint("k", i), "x")
			}
			b := consumer.BatchOf(ms)
			if err := h.HandleBatch(context.Background(), b); err != nil {
				t.Fatal(err)
			}
			for _, msg := range ms {
				if err, _ := b.Result(msg); !consumer.IsUnavailable(err) || !errors.Is(err, errDown) {
					t.Fatalf("outcome with the store down: %v, want unavailable wrapping the store's error", err)
				}
			}
			if got := m.count(t, idempotency.MetricStoreErrors, "custody.idempotency.op", "claim"); got != n {
				t.Fatalf("store errors (claim) = %d, want %d", got, n)
			}
			if lines := log.lines(); len(lines) != 1 {
				t.Fatalf("log after a batch of %d failed claims:\n%v\nwant one warning", n, lines)
			}
		})
	}
}

// downBatchStore is a downStore whose ClaimBatch fails as its Claim does.
type downBatchStore struct {
	*downStore
}

func (s *downBatchStore) ClaimBatch(ctx context.Context, claims []idempotency.ClaimRequest, lease time.Duration) []idempotency.ClaimResult {
	res := make([]idempotency.ClaimResult, len(claims))
	for i, c := range claims {
		res[i].State, res[i].Token, res[i].Err = s.Claim(ctx, c.Key, c.Fingerprint, lease)
	}
	return res
}

func (s *downBatchStore) CompleteBatch(ctx context.Context, held []idempotency.HeldClaim, retention time.Duration) []error {
	return s.Store.(idempotency.BatchStore).CompleteBatch(ctx, held, retention)
}

func (s *downBatchStore) ReleaseBatch(ctx context.Context, held []idempotency.HeldClaim) []error {
	return s.Store.(idempotency.BatchStore).ReleaseBatch(ctx, held)
}

func (s *downBatchStore) ExtendBatch(ctx context.Context, held []idempotency.HeldClaim, lease time.Duration) []error {
	return s.Store.(idempotency.BatchStore).ExtendBatch(ctx, held, lease)
}

// Claims whose batch ended (the handler timeout, the shutdown deadline)
// while they were on their way are given back at once, and nothing runs:
// the redeliveries must not wait on them as overlapping duplicates of
// nothing.
func TestBatchEndedDuringTheClaimsGivesThemBack(t *testing.T) {
	store := &faultyStore{Store: newMemory(t)}
	store.claimDelay.Store(int64(100 * time.Millisecond))
	ctx, cancel := context.WithCancelCause(context.Background())
	ended := errors.New("shutdown deadline")
	time.AfterFunc(20*time.Millisecond, func() { cancel(ended) })
	var runs atomic.Int32
	h := newBatchGuard(t, &counting{Store: store}, func(context.Context, *consumer.Batch) error {
		runs.Add(1)
		return nil
	})
	err := h.HandleBatch(ctx, consumer.BatchOf([]*consumer.Message{msg("a", "x"), msg("b", "x")}))
	if !errors.Is(err, ended) {
		t.Fatalf("HandleBatch = %v, want the cause of the end of its context", err)
	}
	if runs.Load() != 0 {
		t.Fatal("the next handler ran after its batch ended")
	}
	for _, key := range []string{"a", "b"} {
		if s, _, err := store.Claim(context.Background(), key, "", time.Hour); err != nil || s != idempotency.Acquired {
			t.Fatalf("Claim(%q) = %v, %v; want acquired: the claim was left behind", key, s, err)
		}
	}
}

// A claim whose reply came after its lease ran out holds nothing: its
// message does not run, fails as unavailable, and the claim is given back.
func TestBatchLateClaimReplyDoesNotRun(t *testing.T) {
	const lease = 50 * time.Millisecond
	store := &faultyStore{Store: newMemory(t)}
	store.claimDelay.Store(int64(2 * lease))
	var runs atomic.Int32
	h := newBatchGuard(t, store, func(context.Context, *consumer.Batch) error {
		runs.Add(1)
		return nil
	}, idempotency.WithLease(lease), idempotency.WithExtendInterval(lease/5), idempotency.WithLogger(quiet))
	b := consumer.BatchOf([]*consumer.Message{msg("a", "x")})
	if err := h.HandleBatch(context.Background(), b); err != nil {
		t.Fatal(err)
	}
	if err, _ := b.Result(b.Messages[0]); !consumer.IsUnavailable(err) || !errors.Is(err, idempotency.ErrClaimLost) {
		t.Fatalf("outcome after a late claim reply: %v, want unavailable wrapping ErrClaimLost", err)
	}
	if runs.Load() != 0 || store.releases.Load() != 1 {
		t.Fatalf("%d runs and %d releases after a late claim reply, want 0 and 1", runs.Load(), store.releases.Load())
	}
}

func TestNewBatchRefusesANilStoreAndBadOptions(t *testing.T) {
	if _, err := idempotency.NewBatch(nil); err == nil || !contains(err.Error(), "NewBatch(nil store)") {
		t.Fatalf("NewBatch(nil) = %v, want an error naming it", err)
	}
	if _, err := idempotency.NewBatch(newMemory(t), idempotency.WithLease(0)); err == nil || !contains(err.Error(), "WithLease") {
		t.Fatalf("NewBatch with a bad option = %v, want an error naming the option", err)
	}
}
