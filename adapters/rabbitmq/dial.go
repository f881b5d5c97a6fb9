package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// handshakeTimeout bounds TCP connect, TLS and AMQP handshakes when the
// caller's context has no earlier deadline, and a reconnect's opening of its
// channel and consumer. A variable so that tests can lengthen it.
var handshakeTimeout = 30 * time.Second

// dial opens a new connection as the settings say.
func (s *settings) dial(ctx context.Context) (*amqp.Connection, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if s.dialFunc != nil {
		conn, err := s.dialFunc(ctx)
		if err != nil {
			return nil, err
		}
		if conn == nil {
			return nil, errors.New("rabbitmq: the dial function returned neither a connection nor an error")
		}
		if conn.IsRecoveryEnabled() {
			conn.Close()
			return nil, errors.New("rabbitmq: the dial function returned a connection with automatic recovery; disable Config.Recovery, the adapter reconnects by itself")
		}
		return conn, nil
	}
	cfg := s.config
	// amqp091 writes into the configuration it dials with: it adds its
	// capabilities to the client properties and fills in the TLS server
	// name. The adapter dials for every reconnect and for its publisher, at
	// times at once (after a broker restart), and the caller may hand the
	// same configuration to a dead-letter sink: each dial gets its own
	// copies, or those writes race (a fatal concurrent map write).
	cfg.Properties = maps.Clone(cfg.Properties)
	cfg.TLSClientConfig = cfg.TLSClientConfig.Clone()
	// stopWatch ends the watch that closes the socket when ctx ends during
	// the handshakes; it reports false when ctx ended first.
	var stopWatch func() bool
	if cfg.Dial == nil {
		deadline := time.Now().Add(handshakeTimeout)
		if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
			deadline = d
		}
		cfg.Dial = func(network, addr string) (net.Conn, error) {
			d := net.Dialer{Deadline: deadline}
			c, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			// amqp091 clears the deadline once the handshake completes.
			if err := c.SetDeadline(deadline); err != nil {
				c.Close()
				return nil, err
			}
			// The deadline does not see ctx end: Close, during a reconnect
			// to a broker (or a proxy in front of one) that accepts the
			// connection and never answers, would wait for it.
			stopWatch = context.AfterFunc(ctx, func() { c.Close() })
			return c, nil
		}
	}
	conn, err := amqp.DialConfig(s.url, cfg)
	if stopWatch != nil && !stopWatch() {
		// ctx ended during the handshakes, and the socket was closed.
		if err == nil {
			conn.Close()
		}
		err = ctx.Err()
	}
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: dial %s: %w", redact(s.url), err)
	}
	return conn, nil
}

// redact removes the password from an AMQP URL for error messages.
func redact(url string) string {
	u, err := amqp.ParseURI(url)
	if err != nil {
		return "(invalid URL)"
	}
	if u.Password != "" {
		u.Password = "xxxxx"
	}
	return u.String()
}

// address says where the adapter connects, for logs: the URL without its
// password, or that a dial function decides.
func (s *settings) address() string {
	if s.dialFunc != nil {
		return "(WithDialFunc)"
	}
	return redact(s.url)
}
