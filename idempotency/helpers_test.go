package idempotency_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/custody-go/custody/idempotency"
)

func contains(s, sub string) bool { return strings.Contains(s, sub) }

// meter records the middleware's metrics for a test to read.
type meter struct {
	*sdkmetric.MeterProvider
	r *sdkmetric.ManualReader
}

func newMeter(t testing.TB) meter {
	r := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(r))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	return meter{mp, r}
}

// count returns the value of counter name for the attribute key=value (any
// attributes when key is empty).
func (m meter) count(t testing.TB, name, key, value string) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := m.r.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, mt := range sm.Metrics {
			if mt.Name != name {
				continue
			}
			sum, ok := mt.Data.(metricdata.Sum[int64])
			if !ok {
				t.Fatalf("%s is %T, want an int64 sum", name, mt.Data)
			}
			for _, dp := range sum.DataPoints {
				if v, ok := dp.Attributes.Value(attribute.Key(key)); key == "" || ok && v.AsString() == value {
					n += dp.Value
				}
			}
		}
	}
	return n
}

func (m meter) sequential(t testing.TB) int64 {
	return m.count(t, idempotency.MetricDuplicates, "custody.duplicate.kind", "sequential")
}

func (m meter) overlapping(t testing.TB) int64 {
	return m.count(t, idempotency.MetricDuplicates, "custody.duplicate.kind", "overlapping")
}

// faultyStore wraps a Store to count calls and inject failures.
type faultyStore struct {
	idempotency.Store
	extends         atomic.Int64
	extendErr       atomic.Pointer[error]
	extendHangs     atomic.Bool  // Extend blocks until its context ends
	extending       atomic.Int64 // Extend calls running now
	completeErr     atomic.Pointer[error]
	completeErrOnce atomic.Pointer[error] // the next Complete fails with it; the later ones reach the store
	completes       atomic.Int64
	releases        atomic.Int64
	claimed         atomic.Pointer[time.Time]         // when the last Claim returned: the claim runs out no later than this plus its lease
	claimSent       atomic.Pointer[time.Time]         // when the last Claim was sent: the claim runs out no earlier than this plus its lease
	claimDelay      atomic.Int64                      // nanoseconds the reply to a Claim is held back after the store made the claim
	extendUntil     atomic.Pointer[time.Time]         // the latest deadline an Extend was given
	token           atomic.Pointer[idempotency.Token] // the token of the last claim acquired
}

func (s *faultyStore) Claim(ctx context.Context, key, fp string, lease time.Duration) (idempotency.State, idempotency.Token, error) {
	sent := time.Now()
	s.claimSent.Store(&sent)
	st, tok, err := s.Store.Claim(ctx, key, fp, lease)
	if err == nil && st == idempotency.Acquired {
		s.token.Store(&tok)
	}
	time.Sleep(time.Duration(s.claimDelay.Load())) // a slow network, or a stalled client
	now := time.Now()
	s.claimed.Store(&now)
	return st, tok, err
}

func (s *faultyStore) Extend(ctx context.Context, key string, tok idempotency.Token, lease time.Duration) error {
	s.extends.Add(1)
	if d, ok := ctx.Deadline(); ok {
		if p := s.extendUntil.Load(); p == nil || d.After(*p) {
			s.extendUntil.Store(&d)
		}
	}
	s.extending.Add(1)
	defer s.extending.Add(-1)
	if s.extendHangs.Load() {
		<-ctx.Done()
		return ctx.Err()
	}
	if p := s.extendErr.Load(); p != nil {
		return *p
	}
	return s.Store.Extend(ctx, key, tok, lease)
}

func (s *faultyStore) Complete(ctx context.Context, key string, tok idempotency.Token, retention time.Duration) error {
	s.completes.Add(1)
	if p := s.completeErrOnce.Swap(nil); p != nil {
		return *p
	}
	if p := s.completeErr.Load(); p != nil {
		return *p
	}
	return s.Store.Complete(ctx, key, tok, retention)
}

func (s *faultyStore) Release(ctx context.Context, key string, tok idempotency.Token) error {
	s.releases.Add(1)
	return s.Store.Release(ctx, key, tok)
}

// eventually polls cond until it holds or a generous deadline passes.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	end := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
