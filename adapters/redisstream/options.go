package redisstream

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"go.opentelemetry.io/otel/metric"
)

// Defaults for the Source's options.
const (
	// DefaultLease is how long an entry may stay idle in the pending list
	// before another consumer may claim it, when WithLease is not given.
	DefaultLease = 30 * time.Second
	// DefaultBlock is how long one XREADGROUP waits for new entries.
	DefaultBlock = time.Second
	// DefaultReclaimInterval is the longest time between two scans of the
	// pending list for entries idle past the lease (a lease shorter than
	// twice it scans every half lease).
	DefaultReclaimInterval = time.Second
	// DefaultBodyField is the entry field that holds the message body.
	DefaultBodyField = "body"
	// DefaultConsumerCleanup is how long a consumer of the group that holds
	// no pending entry must have been idle before New or Close deletes it.
	DefaultConsumerCleanup = time.Hour
)

// Option configures a [Source].
type Option func(*options) error

type options struct {
	consumer        string
	createStart     string // "" : do not create the group
	lease           time.Duration
	block           time.Duration
	reclaimInterval time.Duration // 0: derived from the lease
	bodyField       string
	deleteOnAck     bool
	cleanup         time.Duration
	meterProvider   metric.MeterProvider
	logger          *slog.Logger
}

func defaultOptions() options {
	return options{
		lease:     DefaultLease,
		block:     DefaultBlock,
		bodyField: DefaultBodyField,
		cleanup:   DefaultConsumerCleanup,
	}
}

// WithConsumer sets this Source's consumer name in the group. Default: the
// host name, the process id and a random suffix, so that every Source, in
// every process, is a consumer of its own. Two processes must never share a
// name: the group would take them for one consumer, and each would renew
// and give back the other's entries.
func WithConsumer(name string) Option {
	return func(o *options) error {
		if name == "" {
			return errors.New("redisstream.WithConsumer(\"\"): give a name, or leave the option out for a unique one")
		}
		o.consumer = name
		return nil
	}
}

// WithCreateGroup makes New create the consumer group, and the stream with
// it (XGROUP CREATE ... MKSTREAM), when the group does not exist, starting
// at start: "$" for entries added from now on, "0" for the whole stream, or
// an entry id. Should the group vanish while the Source runs, Receive
// creates it again from "0" (see A missing group in the package
// documentation). Default: New fails when the group does not exist.
func WithCreateGroup(start string) Option {
	return func(o *options) error {
		if err := checkStart(start); err != nil {
			return err
		}
		o.createStart = start
		return nil
	}
}

// WithLease sets the lease: how long an entry may stay idle in the pending
// list before another consumer's reclaim may claim it. The runtime renews
// every held entry at a third of it. Default 30 s; from 10 ms to 24 h, in
// whole milliseconds. Every consumer of a group must use the same lease: a
// consumer with a shorter one takes entries the others still hold.
func WithLease(d time.Duration) Option {
	return func(o *options) error {
		if d < 10*time.Millisecond || d > 24*time.Hour || d%time.Millisecond != 0 {
			return fmt.Errorf("redisstream.WithLease(%v): must be whole milliseconds from 10ms to 24h", d)
		}
		o.lease = d
		return nil
	}
}

// WithBlock sets how long one XREADGROUP waits for new entries (BLOCK).
// Default 1 s; from 1 ms to 1 min. A Receive waits at most this long, or
// less when a reclaim falls due sooner; go-redis does not cut a blocked
// read short when its context ends, so this is also how long a Receive may
// take to notice its context ended or Close.
func WithBlock(d time.Duration) Option {
	return func(o *options) error {
		if d < time.Millisecond || d > time.Minute {
			return fmt.Errorf("redisstream.WithBlock(%v): must be from 1ms to 1m", d)
		}
		o.block = d
		return nil
	}
}

// WithReclaimInterval sets the longest time between two scans of the
// group's pending list for entries idle past the lease (a consumer that
// died, a retry of another consumer that came due). Default 1 s, or half
// the lease when that is shorter; from 1 ms to the lease.
func WithReclaimInterval(d time.Duration) Option {
	return func(o *options) error {
		if d < time.Millisecond {
			return fmt.Errorf("redisstream.WithReclaimInterval(%v): must be at least 1ms (and at most the lease)", d)
		}
		o.reclaimInterval = d
		return nil
	}
}

// WithBodyField names the entry field that holds the message body. Default
// "body". Every other field becomes a header. An entry without the field
// has an empty body.
func WithBodyField(name string) Option {
	return func(o *options) error {
		if name == "" {
			return errors.New("redisstream.WithBodyField(\"\"): name a field")
		}
		o.bodyField = name
		return nil
	}
}

// WithDeleteOnAck makes Ack delete the acknowledged entries from the stream
// (XDEL) after XACK, in the same round trip; an entry a DeadLetter
// acknowledges is deleted in the same script. Use it only when this group
// is the stream's only reader: XDEL deletes the entry for every group.
// Default off: entries stay until the stream is trimmed.
func WithDeleteOnAck() Option {
	return func(o *options) error {
		o.deleteOnAck = true
		return nil
	}
}

// WithConsumerCleanup sets how long another consumer of the group that holds
// no pending entry must have been idle (as XINFO CONSUMERS reports it) before
// New and Close delete it, so that consumer names of processes long gone do
// not pile up in the group. Zero deletes only this Source's own name, at
// Close, when it holds nothing. Default 1 h. A consumer that holds entries
// is never deleted (see Consumer names in the package documentation).
func WithConsumerCleanup(idle time.Duration) Option {
	return func(o *options) error {
		if idle < 0 {
			return fmt.Errorf("redisstream.WithConsumerCleanup(%v): must not be negative (0 cleans up only this consumer)", idle)
		}
		o.cleanup = idle
		return nil
	}
}

// WithMeterProvider sets where the Source's metrics go. Default: the global
// MeterProvider.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(o *options) error {
		if mp == nil {
			return errors.New("redisstream.WithMeterProvider(nil): pass a provider, or leave the option out for the global one")
		}
		o.meterProvider = mp
		return nil
	}
}

// WithLogger sets where the Source logs what it finds that no call returns:
// entries deleted from the stream while pending, a group that vanished.
// Default slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(o *options) error {
		if l == nil {
			return errors.New("redisstream.WithLogger(nil): pass a logger")
		}
		o.logger = l
		return nil
	}
}

// checkStart refuses a start id XGROUP CREATE would refuse, so that New
// names the option rather than the command.
func checkStart(start string) error {
	if start == "$" || start == "0" {
		return nil
	}
	ms, seq, ok := strings.Cut(start, "-")
	if digits(ms) && (!ok || digits(seq)) {
		return nil
	}
	return fmt.Errorf("redisstream.WithCreateGroup(%q): give a start id: \"$\" (new entries only), \"0\" (the whole stream) or an entry id such as 1700000000000-0", start)
}

func digits(s string) bool {
	if s == "" || len(s) > 20 {
		return false
	}
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}
