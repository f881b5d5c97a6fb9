package jetstream

import (
	"errors"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/custody-go/custody/adapters"
)

var _ adapters.Connector = (*Source)(nil)

// Connection reports the state of the NATS connection the Source uses, as
// nats.go tells it (adapters.Connector): connected; reconnecting while the
// client reconnects after a lost connection; disconnected once the
// connection is closed or draining (it will not come back: make a new
// connection and Source) or the Source is closed. Since is when the Source
// saw the state change, and LastError, while not connected, the
// connection's last error, or a sentence saying what nats.go reports.
func (s *Source) Connection() adapters.Connection {
	return s.conn.connection(s.isClosed())
}

// connWatch follows the state of a NATS connection: a goroutine notes when
// the connection reports a change, and every reading asks the connection
// for its state, so that a missed notification costs only the precision
// of Since.
type connWatch struct {
	nc   *nats.Conn
	ch   chan nats.Status
	done chan struct{}

	mu    sync.Mutex
	state adapters.ConnState
	since time.Time
}

// watchConn starts following nc's state. The goroutine it starts ends when
// stop is called or the connection closes.
func watchConn(nc *nats.Conn) *connWatch {
	w := &connWatch{nc: nc, done: make(chan struct{})}
	w.ch = nc.StatusChanged(nats.CONNECTED, nats.DISCONNECTED, nats.RECONNECTING, nats.CLOSED,
		nats.DRAINING_SUBS, nats.DRAINING_PUBS)
	w.observe(false)
	go w.run()
	return w
}

func (w *connWatch) run() {
	defer close(w.done)
	for range w.ch {
		if w.nc.IsClosed() {
			// Closed for good: nothing more will change. Removing the
			// listener closes the channel, which ends this loop.
			w.nc.RemoveStatusListener(w.ch)
		}
		w.observe(false)
	}
}

// stop ends the goroutine and waits for it.
func (w *connWatch) stop() {
	w.nc.RemoveStatusListener(w.ch)
	<-w.done
}

// observe reads the connection's state (disconnected once the Source is
// closed), notes when it changed, and returns it with that time.
func (w *connWatch) observe(sourceClosed bool) (adapters.ConnState, time.Time) {
	st := adapters.Disconnected
	if !sourceClosed {
		st = connState(w.nc.Status())
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if st != w.state || w.since.IsZero() {
		w.state, w.since = st, time.Now()
	}
	return st, w.since
}

func (w *connWatch) connection(sourceClosed bool) adapters.Connection {
	st, since := w.observe(sourceClosed)
	c := adapters.Connection{State: st, Since: since}
	if st == adapters.Connected || sourceClosed {
		return c
	}
	if c.LastError = w.nc.LastError(); c.LastError == nil {
		c.LastError = stateError(w.nc.Status())
	}
	return c
}

// connState maps nats.go's connection status to the runtime's.
func connState(s nats.Status) adapters.ConnState {
	switch s {
	case nats.CONNECTED:
		return adapters.Connected
	case nats.CONNECTING:
		return adapters.Connecting
	case nats.DISCONNECTED, nats.RECONNECTING:
		return adapters.Reconnecting
	}
	return adapters.Disconnected // closed, or draining before it closes
}

// stateError says what a connection that is not connected is doing, when
// nats.go holds no error for it (it clears its error while it reconnects).
func stateError(s nats.Status) error {
	switch s {
	case nats.DISCONNECTED, nats.RECONNECTING:
		return errors.New("jetstream: the connection to the NATS server was lost; nats.go is reconnecting")
	case nats.CONNECTING:
		return errors.New("jetstream: nats.go is connecting to the NATS server")
	case nats.DRAINING_SUBS, nats.DRAINING_PUBS:
		return errors.New("jetstream: the NATS connection is draining, and closes next; make a new connection and Source")
	}
	return errors.New("jetstream: the NATS connection is closed and does not reconnect; make a new connection and Source")
}
