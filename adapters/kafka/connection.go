package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kgo"
)

var _ adapters.Connector = (*Source)(nil)

// Connection implements adapters.Connector, from the outcome of the
// client's connection attempts (see the package documentation, section
// Operations). Since is when the state began; while not connected,
// LastError is the last failed attempt's error, naming the broker. A broker
// that is down while another serves every partition the Source reads
// leaves it connected (the client drops idle connections, and logs the
// broker it cannot reach; see WithLogger).
func (s *Source) Connection() adapters.Connection { return s.conn.connection() }

// connWatch follows a client's connection attempts, as a franz-go hook
// (kgo.HookBrokerConnect) called once per attempt from the client's
// goroutines. It logs a broker address that stops being reachable and
// reachable again once per change, not once per attempt (franz-go dials
// again by itself, with backoff, for as long as it needs the broker), and
// keeps the state a Source's Connection reports.
type connWatch struct {
	logger *slog.Logger
	what   string // which client: a Source's, a dead-letter sink's, a replay's

	mu sync.Mutex
	// up holds each broker address's state after its last attempt: true
	// if the attempt connected. An address never tried is absent.
	up      map[string]bool
	state   adapters.ConnState
	since   time.Time
	lastErr error
}

func newConnWatch(logger *slog.Logger, what string) *connWatch {
	return &connWatch{logger: logger, what: what, up: make(map[string]bool), state: adapters.Connecting, since: time.Now()}
}

// OnBrokerConnect implements kgo.HookBrokerConnect.
func (w *connWatch) OnBrokerConnect(meta kgo.BrokerMetadata, _ time.Duration, _ net.Conn, err error) {
	if err != nil && (errors.Is(err, context.Canceled) || errors.Is(err, kgo.ErrClientClosed)) {
		return // the client gave up the attempt (closing, or a request's context ended): no news of the broker
	}
	addr := net.JoinHostPort(meta.Host, strconv.Itoa(int(meta.Port)))
	ok := err == nil
	w.mu.Lock()
	was, tried := w.up[addr]
	w.up[addr] = ok
	var down []string
	if !ok {
		for a, up := range w.up {
			if !up {
				down = append(down, a)
			}
		}
		slices.Sort(down)
	}
	switch {
	case w.state == adapters.Disconnected: // Close is final
	case ok:
		w.set(adapters.Connected, nil)
	default:
		w.lastErr = fmt.Errorf("kafka: connecting to broker %s: %w", addr, err)
		if w.state == adapters.Connected && len(down) == len(w.up) { // no broker answers
			w.set(adapters.Reconnecting, w.lastErr)
		}
	}
	w.mu.Unlock()
	switch {
	case !ok && (!tried || was):
		w.logger.Warn("kafka: cannot connect to a broker; the client keeps trying, and logs again once it connects",
			"client", w.what, "broker", addr, "node", kgo.NodeName(meta.NodeID), "error", err, "unreachable", down)
	case ok && tried && !was:
		w.logger.Info("kafka: connected to the broker again",
			"client", w.what, "broker", addr, "node", kgo.NodeName(meta.NodeID))
	}
}

// set changes the state, noting when; the caller holds w.mu.
func (w *connWatch) set(state adapters.ConnState, err error) {
	if state != w.state {
		w.since = time.Now()
	}
	w.state, w.lastErr = state, err
}

// close marks the connection closed for good.
func (w *connWatch) close() {
	w.mu.Lock()
	w.set(adapters.Disconnected, nil)
	w.mu.Unlock()
}

func (w *connWatch) connection() adapters.Connection {
	w.mu.Lock()
	defer w.mu.Unlock()
	c := adapters.Connection{State: w.state, Since: w.since}
	if w.state == adapters.Connecting || w.state == adapters.Reconnecting {
		c.LastError = w.lastErr
	}
	return c
}
