package kafka

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kgo"
)

var _ adapters.Connector = (*Source)(nil)

// Connection implements adapters.Connector, from the outcome of the
// client's connection attempts (franz-go connects to each broker it needs,
// and again after a connection breaks, by itself): Connecting until an
// attempt first succeeds (New returns only then, so a Source a caller holds
// is past it); Connected while the last attempt to at least one broker
// succeeded; Reconnecting once the last attempt to every broker tried has
// failed, until one succeeds; Disconnected once Close was called. Since is
// when the state began. While not connected, LastError is the last failed
// attempt's error, naming the broker; it is nil while connected.
//
// A client holds a connection per broker it talks to, and drops idle ones:
// a broker that is down while another serves every partition the Source
// reads leaves it connected (the client logs the broker it cannot reach;
// see WithLogger). A cluster that is down makes every attempt fail: the
// group's heartbeats and the fetches try at once, so the state turns within
// a heartbeat interval (kgo.HeartbeatInterval, 3s by default) or a retry
// backoff.
//
// The runtime reports it in consumer.Status and its readiness probe: a
// consumer is not ready while its Source reconnects.
func (s *Source) Connection() adapters.Connection { return s.conn.connection() }

// connWatch follows the client's connection attempts, as a franz-go hook
// (kgo.HookBrokerConnect), called from the client's goroutines.
type connWatch struct {
	mu sync.Mutex
	// up holds each broker address's state after its last attempt: true
	// if the attempt connected. An address never tried is absent.
	up      map[string]bool
	state   adapters.ConnState
	since   time.Time
	lastErr error
}

func newConnWatch() *connWatch {
	return &connWatch{up: make(map[string]bool), state: adapters.Connecting, since: time.Now()}
}

// OnBrokerConnect implements kgo.HookBrokerConnect.
func (w *connWatch) OnBrokerConnect(meta kgo.BrokerMetadata, _ time.Duration, _ net.Conn, err error) {
	if err != nil && (errors.Is(err, context.Canceled) || errors.Is(err, kgo.ErrClientClosed)) {
		return // the client gave up the attempt: no news of the broker
	}
	addr := net.JoinHostPort(meta.Host, strconv.Itoa(int(meta.Port)))
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.state == adapters.Disconnected {
		return // Close is final
	}
	w.up[addr] = err == nil
	if err == nil {
		w.set(adapters.Connected, nil)
		return
	}
	w.lastErr = fmt.Errorf("kafka: connecting to broker %s: %w", addr, err)
	for _, up := range w.up {
		if up {
			return // another broker still answers
		}
	}
	if w.state == adapters.Connected {
		w.set(adapters.Reconnecting, w.lastErr)
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
