package rabbitmq

import (
	"time"

	"github.com/custody-go/custody/adapters"
)

var _ adapters.Connector = (*Source)(nil)

// Connection implements adapters.Connector: Connecting until the first
// channel consumes (before New returns), Connected while a channel consumes,
// Reconnecting from the moment the supervisor sees the connection or channel
// die (or the broker cancel the consumer) until a new one consumes, and
// Disconnected once Close was called. While reconnecting, LastError is the
// last failed attempt's error, or before the first one what ended the
// connection.
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
