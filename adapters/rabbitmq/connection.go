package rabbitmq

import (
	"time"

	"github.com/custody-go/custody/adapters"
)

var _ adapters.Connector = (*Source)(nil)

// Connection implements adapters.Connector, from the supervisor's own
// transitions: Connecting until the first channel consumes (New returns
// only then, so a Source a caller holds is past it), Connected while a
// channel consumes, Reconnecting from the moment the supervisor sees the
// connection or channel die (or the broker cancel the consumer) until a
// new channel consumes, and Disconnected once Close was called. Since is
// when the state began. While reconnecting, LastError is the last failed
// attempt's error (the address tried and the cause), or, before the first
// attempt fails, what ended the connection; it is nil while connected.
//
// The runtime reports it in consumer.Status and its readiness probe: a
// consumer is not ready while its Source reconnects.
func (s *Source) Connection() adapters.Connection {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.conn
}

// setConnLocked records a new connection state; the caller holds s.mu.
func (s *Source) setConnLocked(state adapters.ConnState, err error) {
	if s.conn.State == adapters.Disconnected {
		return // Close is final
	}
	if state != s.conn.State {
		s.conn.Since = time.Now()
	}
	s.conn.State, s.conn.LastError = state, err
}
