package kafka

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// connLog logs when a broker address stops being reachable and when it can
// be reached again: once per change, not once per attempt (franz-go dials
// again by itself, with backoff, for as long as it needs the broker). It is
// a franz-go hook (kgo.HookBrokerConnect), called once per connection
// attempt, from the client's goroutines.
type connLog struct {
	logger *slog.Logger
	what   string // which client: the Source's or a dead-letter sink's

	mu sync.Mutex
	// up holds each address's state after its last attempt: true if the
	// attempt connected. An address never tried is absent.
	up map[string]bool
}

func newConnLog(logger *slog.Logger, what string) *connLog {
	return &connLog{logger: logger, what: what, up: make(map[string]bool)}
}

// OnBrokerConnect implements kgo.HookBrokerConnect.
func (l *connLog) OnBrokerConnect(meta kgo.BrokerMetadata, _ time.Duration, _ net.Conn, err error) {
	if err != nil && (errors.Is(err, context.Canceled) || errors.Is(err, kgo.ErrClientClosed)) {
		return // the client gave up the attempt (closing, or a request's context ended): no news of the broker
	}
	addr := net.JoinHostPort(meta.Host, strconv.Itoa(int(meta.Port)))
	ok := err == nil
	l.mu.Lock()
	was, tried := l.up[addr]
	l.up[addr] = ok
	var down []string
	if !ok {
		for a, up := range l.up {
			if !up {
				down = append(down, a)
			}
		}
		slices.Sort(down)
	}
	l.mu.Unlock()
	switch {
	case !ok && (!tried || was):
		l.logger.Warn("kafka: cannot connect to a broker; the client keeps trying, and logs again once it connects",
			"client", l.what, "broker", addr, "node", kgo.NodeName(meta.NodeID), "error", err, "unreachable", down)
	case ok && tried && !was:
		l.logger.Info("kafka: connected to the broker again",
			"client", l.what, "broker", addr, "node", kgo.NodeName(meta.NodeID))
	}
}
