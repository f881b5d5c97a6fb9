package consumer

import (
	"context"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"github.com/custody-go/custody/adapters"
)

// The rate limit of the run's log lines: logBurst lines of each kind per
// window (see the package documentation, section Logs).
const (
	logBurst  = 10
	logWindow = 10 * time.Second
)

// logKind is one kind of line the run logs: a fixed level and message (see
// logLines); the attributes vary.
type logKind uint8

const (
	logRetry logKind = iota
	logDeferred
	logBatchCut
	logUnavailable
	logDeadLettered
	logNoDeadLetter
	logDeadLetterFailed
	logDeadLetterLost
	logDeadLetterCutLost
	logDeadLetterCut
	logPanic
	logErrorPanicked
	logExited
	logAtMostOnceFailed
	logEarlyAckFailed
	logLeaseLost
	logLost
	logGivenBack
	logLeft
	logAckFailed
	logNackFailed
	logRenewalFailed
	logReceiveFailed
	logReceivePartial
	logKillSwitchOpen
	logKillSwitchHalfOpen
	logKillSwitchClosed
	logBacklogFailed
	numLogKinds
)

// logLines gives each kind its level and message. The messages are stable:
// operators search and alert on them.
var logLines = [numLogKinds]struct {
	level slog.Level
	msg   string
}{
	logRetry:              {slog.LevelDebug, "custody: handler failed; the message is retried after a backoff"},
	logDeferred:           {slog.LevelDebug, "custody: handler deferred the message; it is tried again later without using up an attempt"},
	logBatchCut:           {slog.LevelDebug, "custody: batch cut short by the loss of another of its messages; the message runs again without using up an attempt"},
	logUnavailable:        {slog.LevelWarn, "custody: a dependency is unavailable; the message waits in place without using up an attempt"},
	logDeadLettered:       {slog.LevelWarn, "custody: message dead-lettered"},
	logNoDeadLetter:       {slog.LevelError, "custody: message failed for good and there is no dead-letter destination (WithDeadLetter); it is retried after a backoff"},
	logDeadLetterFailed:   {slog.LevelError, "custody: dead-letter write failed; the original is kept and the write tried again"},
	logDeadLetterLost:     {slog.LevelError, "custody: dead-letter write failed and the delivery was lost; the broker redelivers the message"},
	logDeadLetterCutLost:  {slog.LevelWarn, "custody: dead-letter write cut short: the delivery was lost; the broker redelivers the message"},
	logDeadLetterCut:      {slog.LevelWarn, "custody: dead-letter write cut short by the shutdown deadline; the message is given back"},
	logPanic:              {slog.LevelError, "custody: handler panicked; the attempt counts as failed"},
	logErrorPanicked:      {slog.LevelError, "custody: handler returned an error whose Error method panicked; the attempt counts as failed"},
	logExited:             {slog.LevelError, "custody: handler exited without returning (runtime.Goexit); the message is given back"},
	logAtMostOnceFailed:   {slog.LevelWarn, "custody: handler failed in at-most-once mode; the message is gone"},
	logEarlyAckFailed:     {slog.LevelWarn, "custody: ack on receipt failed in at-most-once mode; the message is left to come back, and handled then"},
	logLeaseLost:          {slog.LevelWarn, "custody: lease lost; expect a redelivery"},
	logLost:               {slog.LevelInfo, "custody: delivery lost before it was settled; the broker delivers the message again"},
	logGivenBack:          {slog.LevelDebug, "custody: message given back to the broker"},
	logLeft:               {slog.LevelDebug, "custody: message left to its lease at shutdown (WithLeaveUnfinishedOnShutdown)"},
	logAckFailed:          {slog.LevelWarn, "custody: ack failed; expect a redelivery"},
	logNackFailed:         {slog.LevelWarn, "custody: nack failed; the broker redelivers the message when its lease runs out or its connection closes"},
	logRenewalFailed:      {slog.LevelWarn, "custody: lease renewal failed; trying again before the lease runs out"},
	logReceiveFailed:      {slog.LevelWarn, "custody: receive failed; retrying"},
	logReceivePartial:     {slog.LevelWarn, "custody: receive reported an error with its deliveries"},
	logKillSwitchOpen:     {slog.LevelError, "custody: kill switch tripped: intake stopped; held messages wait without using up attempts"},
	logKillSwitchHalfOpen: {slog.LevelWarn, "custody: kill switch half-open: intake resumed; probing with a few attempts"},
	logKillSwitchClosed:   {slog.LevelWarn, "custody: kill switch closed: the probes succeeded; every message runs again"},
	logBacklogFailed:      {slog.LevelWarn, "custody: asking the source for its backlog failed"},
}

// logSuppressed is the summary line's message.
const logSuppressed = "custody: similar log lines suppressed by the rate limit"

// logLimiter writes a run's log lines, each kind rate-limited on its own.
// It has no goroutine: a window's summary is written by the next line of
// its kind, or by flush when Run returns. A line whose level the logger
// discards costs one Enabled call, and a suppressed one a clock read and
// a lock; neither allocates.
type logLimiter struct {
	logger *slog.Logger // carries the consumer's name
	ctx    context.Context
	now    func() time.Time
	kinds  [numLogKinds]logBucket
}

type logBucket struct {
	mu         sync.Mutex
	start      time.Time // the window's first line
	last       time.Time // its last suppressed line
	lines      int       // written in the window
	suppressed int       // counted and not written in the window
}

func newLogLimiter(ctx context.Context, logger *slog.Logger, name string) *logLimiter {
	return &logLimiter{logger: logger.With("consumer", name), ctx: ctx, now: time.Now}
}

// log writes a line of kind k with attrs, unless the logger discards its
// level or the kind's burst for the window is spent.
func (l *logLimiter) log(k logKind, attrs ...slog.Attr) {
	line := &logLines[k]
	if !l.logger.Enabled(l.ctx, line.level) || !l.admit(k) {
		return
	}
	l.logger.LogAttrs(l.ctx, line.level, line.msg, attrs...)
}

// enabled reports whether a line of kind k would reach the logger's
// handler (burst permitting): for callers that must compute an attribute.
func (l *logLimiter) enabled(k logKind) bool {
	return l.logger.Enabled(l.ctx, logLines[k].level)
}

// admit reports whether a line of kind k may be written now, and counts it
// either way. A line that opens a new window first writes the summary of
// the window before, if it suppressed any.
func (l *logLimiter) admit(k logKind) bool {
	b := &l.kinds[k]
	now := l.now()
	b.mu.Lock()
	if b.lines > 0 && now.Sub(b.start) < logWindow {
		if b.lines < logBurst {
			b.lines++
			b.mu.Unlock()
			return true
		}
		b.suppressed++
		b.last = now
		b.mu.Unlock()
		return false
	}
	n, start, last := b.suppressed, b.start, b.last
	b.start, b.lines, b.suppressed = now, 1, 0
	b.mu.Unlock()
	if n > 0 {
		l.summary(k, n, last.Sub(start))
	}
	return true
}

// flush writes the summary of every kind's window that suppressed lines.
// Run calls it once nothing else can log.
func (l *logLimiter) flush() {
	for k := range l.kinds {
		b := &l.kinds[k]
		b.mu.Lock()
		n, over := b.suppressed, b.last.Sub(b.start)
		b.suppressed = 0
		b.mu.Unlock()
		if n > 0 {
			l.summary(logKind(k), n, over)
		}
	}
}

// summary says that n lines of kind k were suppressed within a span of
// over, at the level of those lines.
func (l *logLimiter) summary(k logKind, n int, over time.Duration) {
	line := &logLines[k]
	l.logger.LogAttrs(l.ctx, line.level, logSuppressed,
		slog.String("line", line.msg), slog.Int("suppressed", n), slog.Duration("over", over),
		slog.Int("limit", logBurst), slog.Duration("window", logWindow))
}

// failureReason says why a message leaves the stream: the reason attribute
// of a dead letter.
func failureReason(err error) string {
	if IsPermanent(err) {
		return "permanent"
	}
	return "exhausted"
}

// logRetry logs a failed or deferred attempt whose message is tried again
// after delay: in place, or by the broker's delayed redelivery (byNack).
func (r *run) logRetry(j *job, err error, attempt int, delay time.Duration, deferred, byNack bool) {
	where := "in place"
	if byNack {
		where = "redelivered"
	}
	if deferred {
		r.logs.log(logDeferred, slog.String("id", j.d.ID), slog.Int("attempt", attempt),
			slog.Duration("retry_in", delay), slog.String("retry", where), slog.Any("error", err))
		return
	}
	r.logs.log(logRetry, slog.String("id", j.d.ID), slog.Int("attempt", attempt),
		slog.Int("max_attempts", r.cfg.retry.MaxAttempts), slog.Duration("retry_in", delay),
		slog.String("retry", where), slog.Any("error", err))
}

// panicked counts and logs a handler's panic with value p, and returns it
// as the attempt's error. The stack is copied into a string for the log
// only when the logger takes the line's level.
func (r *run) panicked(d *adapters.Delivery, attempt int, p any) error {
	pe := &PanicError{Value: p, Stack: debug.Stack()}
	r.tel.panics.Add(r.settleCtx, 1, r.tel.source...)
	if r.logs.enabled(logPanic) {
		r.logs.log(logPanic, slog.String("id", d.ID), slog.Int("attempt", attempt),
			slog.Any("panic", p), slog.String("stack", string(pe.Stack)))
	}
	return pe
}
