package redisstream

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/adapters"
)

var _ adapters.Connector = (*Source)(nil)

// Connection reports whether the Source reaches Redis (adapters.Connector),
// from the outcome of its own commands (a read at least every WithBlock,
// renewals, acks): connected from New on and after any command Redis
// answered, error replies included; reconnecting after one that failed for
// want of a server (no connection, a cut, a timeout, or a server loading its
// data, without its master or cluster, out of client slots, or refusing the
// credentials), until one gets an answer; disconnected once the client or
// the Source is closed. LastError is the failure while not connected. A
// command its caller cancelled changes nothing. The state is as fresh as
// the last command: a consumer paused with nothing held sends none.
func (s *Source) Connection() adapters.Connection {
	if s.isClosed() {
		return s.conn.closed()
	}
	return s.conn.connection()
}

// connTracker keeps the connection state the Source's commands showed.
type connTracker struct {
	mu      sync.Mutex
	state   adapters.ConnState
	since   time.Time
	lastErr error
	// from is when the command whose outcome set the state was sent: an
	// outcome of a command sent earlier does not change it, so that a slow
	// command that failed before the server came back does not undo the
	// answer of one sent since.
	from time.Time
}

// connected sets the state connected at now, as New does once the server
// answered its checks.
func (c *connTracker) connected(now time.Time) {
	c.mu.Lock()
	c.state, c.since, c.from = adapters.Connected, now, now
	c.mu.Unlock()
}

// observe notes the outcome err of a command sent at sent.
func (c *connTracker) observe(sent time.Time, err error) {
	st, ok := stateAfter(err)
	if !ok {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state == adapters.Disconnected && st != adapters.Disconnected && errors.Is(c.lastErr, redis.ErrClosed) {
		return // a closed client stays closed
	}
	if sent.Before(c.from) {
		return
	}
	if st != c.state {
		c.state, c.since = st, time.Now()
	}
	c.from = sent
	if st == adapters.Connected {
		c.lastErr = nil
	} else {
		c.lastErr = err
	}
}

func (c *connTracker) connection() adapters.Connection {
	c.mu.Lock()
	defer c.mu.Unlock()
	return adapters.Connection{State: c.state, Since: c.since, LastError: c.lastErr}
}

// closed reports the connection of a closed Source.
func (c *connTracker) closed() adapters.Connection {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state != adapters.Disconnected {
		c.state, c.since, c.lastErr = adapters.Disconnected, time.Now(), nil
	}
	return adapters.Connection{State: c.state, Since: c.since, LastError: c.lastErr}
}

// stateAfter returns the state a command's outcome shows, and false when it
// shows nothing (cancelled by its caller).
func stateAfter(err error) (adapters.ConnState, bool) {
	switch {
	case err == nil, errors.Is(err, redis.Nil):
		return adapters.Connected, true
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		// The caller gave up (shutdown, a renewal's deadline): no sign
		// of the server either way.
		return 0, false
	case errors.Is(err, redis.ErrClosed):
		return adapters.Disconnected, true
	case redis.IsLoadingError(err), redis.IsMasterDownError(err), redis.IsClusterDownError(err),
		redis.IsMaxClientsError(err), redis.IsAuthError(err):
		return adapters.Reconnecting, true
	}
	var reply redis.Error
	if errors.As(err, &reply) {
		return adapters.Connected, true // Redis answered: NOGROUP, WRONGTYPE, a script's error
	}
	return adapters.Reconnecting, true
}
