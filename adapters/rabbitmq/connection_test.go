package rabbitmq

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// refusingDial dials the test broker until refuse is set, and fails with
// "test: broker unreachable" while it is.
func refusingDial(refuse *atomic.Bool) Option {
	return WithDialFunc(func(ctx context.Context) (*amqp.Connection, error) {
		if refuse.Load() {
			return nil, errors.New("test: broker unreachable")
		}
		return amqp.Dial(brokerURL)
	})
}

// The Source reports the supervisor's transitions: connected once New
// returns, reconnecting (since the loss, with the failed attempts' error)
// while the broker cannot be reached, connected again after, and
// disconnected once closed.
func TestConnectionFollowsTheSupervisor(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	var refuse atomic.Bool
	before := time.Now()
	s, err := New(context.Background(), q, refusingDial(&refuse), WithReconnectBackoff(10*time.Millisecond, 50*time.Millisecond),
		WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c := s.Connection()
	if c.State != adapters.Connected || c.Since.Before(before) || c.LastError != nil {
		t.Fatalf("after New: %+v, want connected since New, no error", c)
	}

	refuse.Store(true)
	cut := time.Now()
	killConnection(t, s)
	waitUntil(t, "a failed reconnection to be reported", func() bool {
		c = s.Connection()
		return c.LastError != nil && strings.Contains(c.LastError.Error(), "broker unreachable")
	})
	if c.State != adapters.Reconnecting || c.Since.Before(cut) {
		t.Fatalf("while the broker is unreachable: %+v, want reconnecting since the cut", c)
	}
	if !strings.Contains(c.LastError.Error(), q) {
		t.Errorf("LastError %q does not name the queue", c.LastError)
	}
	// Failed attempts keep the state's start.
	since := c.Since
	waitUntil(t, "another failed attempt", func() bool { return s.Stats().Generations == 1 && time.Since(since) > 100*time.Millisecond })
	if c = s.Connection(); c.State != adapters.Reconnecting || !c.Since.Equal(since) {
		t.Fatalf("after more failed attempts: %+v, want reconnecting since %v", c, since)
	}

	refuse.Store(false)
	waitGenerations(t, s, 2)
	if c = s.Connection(); c.State != adapters.Connected || c.LastError != nil || !c.Since.After(since) {
		t.Fatalf("after the reconnection: %+v, want connected since then, no error", c)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if c = s.Connection(); c.State != adapters.Disconnected {
		t.Fatalf("after Close: %+v, want disconnected", c)
	}
}

// Readiness flips false while RabbitMQ is cut and true after: the
// consumer's Status and its readiness probe report the Source reconnecting,
// with why, and ready again once it consumes, and the messages published
// meanwhile are handled.
func TestReadinessFollowsTheConnection(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	var refuse atomic.Bool
	s, err := New(context.Background(), q, refusingDial(&refuse), WithReconnectBackoff(10*time.Millisecond, 50*time.Millisecond),
		WithPollWait(50*time.Millisecond), WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	var h handled
	r := runConsumer(t, s, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		h.add(m.ID)
		return nil
	}))
	probe := func() (int, consumer.Status) {
		rec := httptest.NewRecorder()
		r.c.ReadyHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		var st consumer.Status
		if err := json.Unmarshal(rec.Body.Bytes(), &st); err != nil {
			t.Fatalf("readiness body %q: %v", rec.Body, err)
		}
		return rec.Code, st
	}
	a.publish(q, "before")
	waitUntil(t, "the consumer to be ready", func() bool { return r.c.Status().Ready })
	waitUntil(t, "the first message handled", func() bool { return h.distinct() == 1 })
	if code, st := probe(); code != http.StatusOK || st.Connection.State != "connected" {
		t.Fatalf("readiness while connected: %d %+v", code, st)
	}

	refuse.Store(true)
	killConnection(t, s)
	waitUntil(t, "the consumer to report the reconnection", func() bool {
		st := r.c.Status()
		return !st.Ready && strings.Contains(st.Connection.LastError, "broker unreachable")
	})
	code, st := probe()
	if code != http.StatusServiceUnavailable || st.Ready || st.Connection.State != "reconnecting" || st.Reason != "reconnecting" || !st.Live {
		t.Fatalf("readiness while RabbitMQ is cut: %d %+v; want 503, live, not ready, reconnecting", code, st)
	}
	a.publish(q, "during")

	refuse.Store(false)
	waitUntil(t, "the consumer to be ready again", func() bool { return r.c.Status().Ready })
	if code, st := probe(); code != http.StatusOK || st.Connection.State != "connected" || st.Connection.LastError != "" {
		t.Fatalf("readiness after the reconnection: %d %+v", code, st)
	}
	waitUntil(t, "the message published while cut to be handled", func() bool { return h.distinct() == 2 })
}
