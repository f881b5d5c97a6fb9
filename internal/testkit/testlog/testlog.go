// Package testlog routes slog output to a test's log, so a failing test shows
// what the runtime said and a passing one stays quiet.
package testlog

import (
	"log/slog"
	"strings"
	"sync"
	"testing"
)

// New returns a logger that writes through t.Log until the test ends.
func New(t testing.TB) *slog.Logger {
	w := &writer{t: t}
	t.Cleanup(func() { w.mu.Lock(); w.done = true; w.mu.Unlock() })
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type writer struct {
	mu   sync.Mutex
	t    testing.TB
	done bool
}

func (w *writer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Helper()
		w.t.Log(strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}
