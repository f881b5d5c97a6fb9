package consumer

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/custody-go/custody/adapters"
)

// State is where a Consumer is in its life.
type State int

const (
	// StateIdle: Run has not been called.
	StateIdle State = iota
	// StateRunning: receiving and handling messages.
	StateRunning
	// StatePaused: handling what it holds, receiving nothing (Pause, or a
	// tripped kill switch).
	StatePaused
	// StateDraining: shutting down, finishing or giving back what it holds.
	StateDraining
	// StateStopped: Run has returned.
	StateStopped
)

var stateNames = [...]string{"idle", "running", "paused", "draining", "stopped"}

func (s State) String() string {
	if s < 0 || int(s) >= len(stateNames) {
		return "unknown"
	}
	return stateNames[s]
}

// MarshalText names the state in JSON.
func (s State) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// UnmarshalText reads a state MarshalText wrote.
func (s *State) UnmarshalText(b []byte) error {
	for v, name := range stateNames {
		if name == string(b) {
			*s = State(v)
			return nil
		}
	}
	return fmt.Errorf("consumer: unknown state %q", b)
}

// Status is a snapshot of a Consumer, for health checks, readiness probes
// and dashboards.
type Status struct {
	State State `json:"state"`
	// Live is false when Run is not running, or when a Receive has not
	// returned for StuckAfter (the adapter's call hangs). A consumer that
	// is paused, or whose handlers are all busy, is live.
	Live bool `json:"live"`
	// Ready is true while the consumer runs (paused or not), its source
	// is connected (see adapters.Connector) and its kill switch, if any,
	// is closed; false while it connects, reconnects, drains or is
	// tripped.
	Ready bool `json:"ready"`
	// Reason says why the consumer is not live or not ready.
	Reason string `json:"reason,omitempty"`
	// KillSwitch is the kill switch's state: "closed", "open",
	// "half-open"; empty without WithKillSwitch.
	KillSwitch string `json:"kill_switch,omitempty"`
	// Connection is what the source reports of its connection; the zero
	// value for sources that report none.
	Connection Connection `json:"connection"`
	// LastReceive is when a Receive last returned deliveries; LastAck is
	// when an ack last succeeded.
	LastReceive time.Time `json:"last_receive"`
	LastAck     time.Time `json:"last_ack"`
	// Held is the deliveries held (running, waiting, awaiting their ack);
	// Running the handler calls under way.
	Held    int `json:"held"`
	Running int `json:"running"`
	// LeasesLost and DeadLetters count the leases lost and the messages
	// dead-lettered over the last minute.
	LeasesLost  int `json:"leases_lost_1m"`
	DeadLetters int `json:"dead_letters_1m"`
	// Assigned is the source's share of the stream (a Kafka member's
	// partitions), where it reports one (adapters.Assigner).
	Assigned []string `json:"assigned,omitempty"`
	// Backlog is the source's backlog as last polled (see
	// WithBacklogInterval), and BacklogAt when; zero when the source
	// reports none.
	Backlog   adapters.Backlog `json:"backlog"`
	BacklogAt time.Time        `json:"backlog_at"`
}

// Connection is a source's connection state, in Status.
type Connection struct {
	State     string    `json:"state,omitempty"`
	Since     time.Time `json:"since"`
	LastError string    `json:"last_error,omitempty"`
}

// StuckAfter is how long a Receive may go without returning before the
// consumer reports itself not live: far longer than any long poll.
const StuckAfter = 5 * time.Minute

// Status returns a snapshot of c. It is safe to call from any goroutine,
// before, during and after Run.
func (c *Consumer) Status() Status {
	st := Status{State: State(c.state.Load())}
	r := c.cur.Load()
	if r == nil {
		st.Reason = "Run is not running"
		if st.State == StateIdle {
			st.Reason = "Run has not been called"
		}
		return st
	}
	now := time.Now()
	st.LastReceive = unixTime(r.lastReceive.Load())
	st.LastAck = unixTime(r.lastAck.Load())
	st.Held = int(r.holding.Load())
	st.Running = int(r.running.Load())
	st.LeasesLost = r.leasesLostMin.sum(now)
	st.DeadLetters = r.deadLettersMin.sum(now)
	if a, ok := c.src.(adapters.Assigner); ok {
		st.Assigned = a.Assigned()
	}
	if b := r.backlog.Load(); b != nil {
		st.Backlog, st.BacklogAt = b.backlog, b.at
	}
	if r.kill != nil {
		st.KillSwitch = r.kill.stateName()
	}
	connected := r.received.Load()
	if cn, ok := c.src.(adapters.Connector); ok {
		conn := cn.Connection()
		st.Connection = Connection{State: conn.State.String(), Since: conn.Since}
		if conn.LastError != nil {
			st.Connection.LastError = conn.LastError.Error()
		}
		connected = conn.State == adapters.Connected
	}

	st.Live = st.State == StateRunning || st.State == StatePaused || st.State == StateDraining
	if since := r.receivingSince.Load(); since != 0 && now.Sub(time.Unix(0, since)) > StuckAfter {
		st.Live = false
		st.Reason = "a Receive has not returned for " + StuckAfter.String()
	}
	switch {
	case !st.Live:
	case st.State == StateDraining:
		st.Reason = "draining"
	case !connected:
		st.Reason = "not connected to the broker"
		if st.Connection.State != "" {
			st.Reason = st.Connection.State
		}
	case st.KillSwitch == "open" || st.KillSwitch == "half-open":
		st.Reason = "kill switch " + st.KillSwitch
	default:
		st.Ready = true
	}
	return st
}

// LiveHandler is an http.Handler for a liveness probe: 200 while the
// consumer is live (see Status.Live), 503 otherwise, with the status as
// JSON. Kubernetes restarts a pod whose liveness probe fails: it fails only
// when Run is not running or the runtime's own loop is stuck, never because
// a handler is slow or the broker is unreachable.
func (c *Consumer) LiveHandler() http.Handler {
	return statusHandler(c, func(s Status) bool { return s.Live })
}

// ReadyHandler is an http.Handler for a readiness probe: 200 while the
// consumer is ready (see Status.Ready), 503 otherwise, with the status as
// JSON. It is false while the source connects or reconnects, while the
// consumer drains, and while its kill switch is tripped.
func (c *Consumer) ReadyHandler() http.Handler {
	return statusHandler(c, func(s Status) bool { return s.Ready })
}

func statusHandler(c *Consumer, ok func(Status) bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		st := c.Status()
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		if !ok(st) {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(st)
	})
}

func unixTime(ns int64) time.Time {
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

// minuteCount counts events over the last minute, in one-second buckets.
type minuteCount struct {
	mu      sync.Mutex
	buckets [60]struct {
		sec int64
		n   int
	}
}

func (m *minuteCount) add(now time.Time, n int) {
	sec := now.Unix()
	b := &m.buckets[sec%60]
	m.mu.Lock()
	if b.sec != sec {
		b.sec, b.n = sec, 0
	}
	b.n += n
	m.mu.Unlock()
}

func (m *minuteCount) sum(now time.Time) int {
	sec := now.Unix()
	m.mu.Lock()
	defer m.mu.Unlock()
	total := 0
	for _, b := range m.buckets {
		if sec-b.sec < 60 {
			total += b.n
		}
	}
	return total
}

// storeNow stores the current time in t.
func storeNow(t *atomic.Int64) { t.Store(time.Now().UnixNano()) }
