package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// logRecorder is a slog handler that keeps what it is given, with the
// attributes of its logger (WithAttrs) merged in, and passes it on to the
// test's log.
type logRecorder struct {
	store *logStore
	attrs []slog.Attr
	next  slog.Handler
}

type logStore struct {
	level slog.Level
	mu    sync.Mutex
	lines []logLine
}

type logLine struct {
	level slog.Level
	msg   string
	attrs map[string]slog.Value
}

func (l logLine) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%v %q", l.level, l.msg)
	for k, v := range l.attrs {
		fmt.Fprintf(&b, " %s=%v", k, v)
	}
	return b.String()
}

// recordLogs returns a logger that records lines at level and above, and
// writes them to the test's log.
func recordLogs(t *testing.T, level slog.Level) (*slog.Logger, *logStore) {
	s := &logStore{level: level}
	return slog.New(&logRecorder{store: s, next: testlog.New(t).Handler()}), s
}

func (h *logRecorder) Enabled(_ context.Context, l slog.Level) bool { return l >= h.store.level }

func (h *logRecorder) Handle(ctx context.Context, r slog.Record) error {
	line := logLine{level: r.Level, msg: r.Message, attrs: map[string]slog.Value{}}
	for _, a := range h.attrs {
		line.attrs[a.Key] = a.Value
	}
	r.Attrs(func(a slog.Attr) bool { line.attrs[a.Key] = a.Value.Resolve(); return true })
	h.store.mu.Lock()
	h.store.lines = append(h.store.lines, line)
	h.store.mu.Unlock()
	return h.next.Handle(ctx, r)
}

func (h *logRecorder) WithAttrs(as []slog.Attr) slog.Handler {
	return &logRecorder{store: h.store, attrs: append(append([]slog.Attr(nil), h.attrs...), as...), next: h.next.WithAttrs(as)}
}

func (h *logRecorder) WithGroup(string) slog.Handler { return h }

func (s *logStore) all() []logLine {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]logLine(nil), s.lines...)
}

// with returns the lines whose message starts with prefix.
func (s *logStore) with(prefix string) []logLine {
	var out []logLine
	for _, l := range s.all() {
		if strings.HasPrefix(l.msg, prefix) {
			out = append(out, l)
		}
	}
	return out
}

const (
	msgDeadLettered = "custody: message dead-lettered"
	msgRetry        = "custody: handler failed; the message is retried"
	msgGivenBack    = "custody: message given back to the broker"
	msgSuppressed   = "custody: similar log lines suppressed by the rate limit"
	msgReceiveError = "custody: receive reported an error with its deliveries"
)

// runLogged runs h over src with logger until stop, and returns after Run
// did, so that every line of the run, its summaries included, is written.
func runLogged(t *testing.T, src adapters.Source, h consumer.HandlerFunc, logger *slog.Logger, until func() bool, opts ...consumer.Option) {
	t.Helper()
	c, err := consumer.New(src, h, append([]consumer.Option{consumer.WithLogger(logger)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	waitFor(t, "the run's work", until)
	cancel()
	if err := await(t, "Run to return", done); err != nil {
		t.Fatal(err)
	}
}

// A poison storm writes the rate limit's burst of dead-letter lines and a
// summary of the rest, not one line per message; every message still
// reaches the dead-letter queue.
func TestPoisonStormLogsTheBurstAndASummary(t *testing.T) {
	const n = 500
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	for i := 0; i < n; i++ {
		e.publish(fmt.Sprint("poison-", i))
	}
	logger, logs := recordLogs(t, slog.LevelInfo)
	runLogged(t, e.source(), func(context.Context, *consumer.Message) error {
		return consumer.Permanent(errors.New("cannot parse"))
	}, logger, func() bool { return e.stats("dlq").Visible == n },
		consumer.WithDeadLetter(e.dlq()), consumer.WithConcurrency(8))

	lines, summaries, suppressed := 0, 0, int64(0)
	for _, l := range logs.all() {
		switch l.msg {
		case msgDeadLettered:
			lines++
		case msgSuppressed:
			if l.attrs["line"].String() != msgDeadLettered || l.level != slog.LevelWarn {
				t.Fatalf("unexpected summary: %v", l)
			}
			summaries++
			suppressed += l.attrs["suppressed"].Int64()
		default:
			t.Errorf("unexpected line in a poison storm: %v", l)
		}
	}
	// Each window writes at most the burst and one summary; a storm that
	// takes less than a window (most runs) writes 10 lines and one summary.
	if lines > 10*(summaries+1) || summaries == 0 {
		t.Fatalf("%d dead-letter lines and %d summaries for %d dead letters: the rate limit (10 lines a window) did not hold", lines, summaries, n)
	}
	if int64(lines)+suppressed != n {
		t.Fatalf("%d lines written + %d suppressed, want %d: the summaries must account for every dead letter", lines, suppressed, n)
	}
}

// A single dead letter writes one WARN line that says which message, why,
// after how many attempts, and with what error.
func TestDeadLetterLogsOneWarning(t *testing.T) {
	for _, tc := range []struct {
		name     string
		err      error
		attempts int64
		reason   string
	}{
		{"exhausted", errors.New("payment service said 500"), 3, "exhausted"},
		{"permanent", consumer.Permanent(errors.New("cannot parse")), 1, "permanent"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
			e.publish("m")
			logger, logs := recordLogs(t, slog.LevelInfo)
			var id string
			runLogged(t, e.source(), func(_ context.Context, m *consumer.Message) error {
				id = m.ID
				return tc.err
			}, logger, func() bool { return e.stats("dlq").Visible == 1 },
				consumer.WithName("orders"), consumer.WithDeadLetter(e.dlq()), fastRetry(3))
			all := logs.all()
			if len(all) != 1 {
				t.Fatalf("%d lines, want the dead letter's only: %v", len(all), all)
			}
			l := all[0]
			if l.msg != msgDeadLettered || l.level != slog.LevelWarn {
				t.Fatalf("line %v, want a WARN %q", l, msgDeadLettered)
			}
			want := map[string]string{"consumer": "orders", "id": id, "reason": tc.reason,
				"attempts": fmt.Sprint(tc.attempts), "error": tc.err.Error()}
			for k, v := range want {
				if got := l.attrs[k].String(); got != v {
					t.Errorf("%s = %q, want %q", k, got, v)
				}
			}
		})
	}
}

// Retries log at DEBUG, with the attempt, the delay and the error, and only
// when the logger's level lets DEBUG through.
func TestRetriesLogAtDebugOnly(t *testing.T) {
	for _, level := range []slog.Level{slog.LevelInfo, slog.LevelDebug} {
		t.Run(level.String(), func(t *testing.T) {
			e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
			e.publish("m")
			logger, logs := recordLogs(t, level)
			calls := newCounter()
			var id string
			runLogged(t, e.source(), func(_ context.Context, m *consumer.Message) error {
				id = m.ID
				if calls.inc(m.Body) == 1 {
					return errors.New("flaky dependency")
				}
				return nil
			}, logger, func() bool { return e.stats("q").Acked == 1 }, consumer.WithDeadLetter(e.dlq()),
				consumer.WithRetry(consumer.Retry{MaxAttempts: 5, Backoff: consumer.ConstantBackoff(7 * time.Millisecond)}))
			retries := logs.with(msgRetry)
			if level > slog.LevelDebug {
				if all := logs.all(); len(all) != 0 {
					t.Fatalf("%d lines at %v, want none: %v", len(all), level, all)
				}
				return
			}
			if len(retries) != 1 {
				t.Fatalf("%d retry lines, want 1: %v", len(retries), logs.all())
			}
			l := retries[0]
			if l.level != slog.LevelDebug || l.attrs["id"].String() != id || l.attrs["attempt"].Int64() != 1 ||
				l.attrs["retry_in"].Duration() != 7*time.Millisecond || l.attrs["error"].String() != "flaky dependency" {
				t.Fatalf("retry line %v", l)
			}
		})
	}
}

// A message given back at shutdown says so at DEBUG, with the reason. (It
// waits for its retry in place, as on Kafka: the memory broker would take it
// back with the retry's delay instead.)
func TestGivenBackAtShutdownLogsTheReason(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("m")
	logger, logs := recordLogs(t, slog.LevelDebug)
	var id string
	failed := make(chan struct{}, 1)
	runLogged(t, inPlaceSource{e.source()}, func(_ context.Context, m *consumer.Message) error {
		id = m.ID
		select {
		case failed <- struct{}{}:
		default:
		}
		return consumer.RetryAfter(errors.New("later"), time.Hour)
	}, logger, func() bool { return len(failed) == 1 && len(logs.with(msgRetry)) == 1 })
	back := logs.with(msgGivenBack)
	if len(back) != 1 || back[0].attrs["id"].String() != id || back[0].attrs["reason"].String() != "shutdown" {
		t.Fatalf("given-back lines %v, want one for %s with reason shutdown", back, id)
	}
}

// partialReceiver reports an error with every batch it receives, as a
// Kafka poll with one failing partition does.
type partialReceiver struct{ *memory.Source }

func (s partialReceiver) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	ds, err := s.Source.Receive(ctx, max)
	if err == nil && len(ds) > 0 {
		err = errors.New("partition 3: not the leader")
	}
	return ds, err
}

// Errors of the consumer as a whole, such as a receive's, are rate-limited
// as the messages' are.
func TestReceiveErrorsAreRateLimited(t *testing.T) {
	const n = 100
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	for i := 0; i < n; i++ {
		e.publish(fmt.Sprint(i))
	}
	logger, logs := recordLogs(t, slog.LevelInfo)
	runLogged(t, partialReceiver{e.source()}, func(context.Context, *consumer.Message) error { return nil },
		logger, func() bool { return e.stats("q").Acked == n }, consumer.WithMaxInFlight(1))
	lines := len(logs.with(msgReceiveError))
	var suppressed int64
	for _, s := range logs.with(msgSuppressed) {
		suppressed += s.attrs["suppressed"].Int64()
	}
	if lines > 10*(len(logs.with(msgSuppressed))+1) || suppressed == 0 {
		t.Fatalf("%d receive-error lines, %d suppressed, for %d receives", lines, suppressed, n)
	}
	if int64(lines)+suppressed != n {
		t.Fatalf("%d lines + %d suppressed, want %d receives", lines, suppressed, n)
	}
}
