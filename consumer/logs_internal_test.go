package consumer

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"
)

// lineRecorder keeps the records a logger writes.
type lineRecorder struct {
	mu    sync.Mutex
	level slog.Level
	recs  []slog.Record
}

func (h *lineRecorder) Enabled(_ context.Context, l slog.Level) bool { return l >= h.level }
func (h *lineRecorder) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	h.recs = append(h.recs, r.Clone())
	h.mu.Unlock()
	return nil
}
func (h *lineRecorder) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *lineRecorder) WithGroup(string) slog.Handler      { return h }

func (h *lineRecorder) take() []slog.Record {
	h.mu.Lock()
	defer h.mu.Unlock()
	recs := h.recs
	h.recs = nil
	return recs
}

func attrOf(r slog.Record, key string) (slog.Value, bool) {
	var v slog.Value
	found := false
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == key {
			v, found = a.Value, true
			return false
		}
		return true
	})
	return v, found
}

// fakeClock is a clock the test moves.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time { return c.t }

func newTestLimiter(level slog.Level) (*logLimiter, *lineRecorder, *fakeClock) {
	rec := &lineRecorder{level: level}
	clock := &fakeClock{t: time.Unix(1_000_000, 0)}
	l := newLogLimiter(context.Background(), slog.New(rec), "test")
	l.now = clock.now
	return l, rec, clock
}

// Each kind writes its burst per window, then counts; the next line after
// the window first reports how many were suppressed, and so does flush.
// Kinds are limited apart.
func TestLogLimiterBurstWindowAndSummaries(t *testing.T) {
	l, rec, clock := newTestLimiter(slog.LevelInfo)
	for i := 0; i < 25; i++ {
		l.log(logDeadLettered, slog.Int("n", i))
		clock.t = clock.t.Add(100 * time.Millisecond)
	}
	l.log(logLeaseLost) // another kind: its own burst
	recs := rec.take()
	if len(recs) != logBurst+1 {
		t.Fatalf("%d lines written in the first window, want %d dead letters and a lost lease", len(recs), logBurst)
	}
	for i, r := range recs[:logBurst] {
		if r.Message != logLines[logDeadLettered].msg || r.Level != slog.LevelWarn {
			t.Fatalf("line %d: %v %q", i, r.Level, r.Message)
		}
	}
	if recs[logBurst].Message != logLines[logLeaseLost].msg {
		t.Fatalf("the lost lease was suppressed by the dead letters' limit: %q", recs[logBurst].Message)
	}

	// The window has passed: a summary, then the line.
	clock.t = clock.t.Add(logWindow)
	l.log(logDeadLettered, slog.Int("n", 25))
	recs = rec.take()
	if len(recs) != 2 {
		t.Fatalf("%d lines after the window, want the summary and the line", len(recs))
	}
	sum := recs[0]
	if sum.Message != logSuppressed || sum.Level != slog.LevelWarn {
		t.Fatalf("summary: %v %q", sum.Level, sum.Message)
	}
	if v, _ := attrOf(sum, "suppressed"); v.Int64() != 15 {
		t.Fatalf("summary says %v suppressed, want 15", v)
	}
	if v, _ := attrOf(sum, "line"); v.String() != logLines[logDeadLettered].msg {
		t.Fatalf("summary names line %q", v)
	}
	if v, _ := attrOf(sum, "over"); v.Duration() != 2400*time.Millisecond {
		t.Fatalf("summary says over %v, want 2.4s (from the window's first line to its last)", v)
	}
	if v, _ := attrOf(recs[1], "n"); v.Int64() != 25 {
		t.Fatalf("after the summary: %v", recs[1])
	}

	// Suppressed at the end: flush reports them once.
	for i := 0; i < logBurst+3; i++ {
		l.log(logDeadLettered)
	}
	rec.take()
	l.flush()
	l.flush()
	recs = rec.take()
	if len(recs) != 1 || recs[0].Message != logSuppressed {
		t.Fatalf("flush wrote %d lines, want one summary", len(recs))
	}
	if v, _ := attrOf(recs[0], "suppressed"); v.Int64() != 4 {
		t.Fatalf("flush's summary says %v suppressed, want 4", v)
	}
}

// A line whose level the logger discards is neither written nor counted:
// no summary reports it.
func TestLogLimiterSkipsDisabledLevels(t *testing.T) {
	l, rec, _ := newTestLimiter(slog.LevelInfo)
	for i := 0; i < 3*logBurst; i++ {
		l.log(logRetry, slog.Int("n", i))
	}
	l.flush()
	if recs := rec.take(); len(recs) != 0 {
		t.Fatalf("%d lines written for a disabled level: %v", len(recs), recs[0].Message)
	}
}

// The hot path pays no allocation for a DEBUG line when debug is off, nor
// for a line the limit suppresses.
func TestLogLimiterAllocatesNothingWhenNotWriting(t *testing.T) {
	err := errors.New("boom")
	id := "message-1"
	l, _, _ := newTestLimiter(slog.LevelInfo)
	if n := testing.AllocsPerRun(100, func() {
		l.log(logRetry, slog.String("id", id), slog.Int("attempt", 2), slog.Int("max_attempts", 5),
			slog.Duration("retry_in", time.Second), slog.String("retry", "in place"), slog.Any("error", err))
	}); n != 0 {
		t.Errorf("a disabled DEBUG line allocates %v times", n)
	}
	for i := 0; i < logBurst; i++ {
		l.log(logDeadLettered)
	}
	if n := testing.AllocsPerRun(100, func() {
		l.log(logDeadLettered, slog.String("id", id), slog.String("reason", "permanent"),
			slog.Int("attempts", 1), slog.Any("error", err))
	}); n != 0 {
		t.Errorf("a suppressed WARN line allocates %v times", n)
	}
}

// Every kind has a message and a level.
func TestLogLinesAreComplete(t *testing.T) {
	seen := map[string]bool{}
	for k, line := range logLines {
		if line.msg == "" {
			t.Errorf("log kind %d has no message", k)
		}
		if seen[line.msg] {
			t.Errorf("log kind %d repeats the message %q: a summary could not tell them apart", k, line.msg)
		}
		seen[line.msg] = true
	}
}
