package awssqs

import (
	"fmt"
	"time"

	"go.opentelemetry.io/otel/metric"
)

// Defaults for the Source's options.
const (
	// DefaultWaitTime is the long-poll wait of each ReceiveMessage call,
	// SQS's maximum: fewest empty receives, so fewest billed requests.
	DefaultWaitTime = 20 * time.Second
	// DefaultMaxMessages is how many messages each ReceiveMessage call asks
	// for, SQS's maximum.
	DefaultMaxMessages = 10
	// DefaultPollers is how many ReceiveMessage calls the runtime may have
	// in flight at once on a standard queue when WithPollers is not given.
	DefaultPollers = 8
	// DefaultAckLinger is how long the runtime may hold a finished message's
	// delete to fill a batch of ten.
	DefaultAckLinger = 20 * time.Millisecond
	// DefaultNackLinger is how long the runtime may hold a nack to fill a
	// ChangeMessageVisibilityBatch of ten.
	DefaultNackLinger = 10 * time.Millisecond
	// MaxLeaseAge is SQS's cap on how long a received message can be kept
	// invisible: 12 hours.
	MaxLeaseAge = 12 * time.Hour
)

// Option configures a [Source].
type Option func(*options) error

type options struct {
	waitTime         time.Duration
	maxMessages      int
	pollers          int // 0: DefaultPollers, or 1 on a FIFO queue
	visibility       time.Duration
	attributeNames   []string
	ackLinger        time.Duration
	nackLinger       time.Duration
	emptyPollBackoff time.Duration
	requestTimeout   time.Duration // bounds each request but a receive's long poll
	meterProvider    metric.MeterProvider
}

func defaultOptions() options {
	return options{
		waitTime:         DefaultWaitTime,
		maxMessages:      DefaultMaxMessages,
		attributeNames:   []string{"All"},
		ackLinger:        DefaultAckLinger,
		nackLinger:       DefaultNackLinger,
		emptyPollBackoff: time.Second,
		requestTimeout:   30 * time.Second,
	}
}

// WithWaitTime sets the long-poll wait of each ReceiveMessage call, in whole
// seconds from 0 to 20. Default 20 s. Zero makes short polls, and an empty
// one is followed by a one-second pause so an idle queue is not polled in a
// hot loop. (aws-sdk-go-v2 leaves a zero wait out of the request, so the
// queue's ReceiveMessageWaitTimeSeconds applies then.)
func WithWaitTime(d time.Duration) Option {
	return func(o *options) error {
		if !wholeSeconds(d, 0, 20*time.Second) {
			return fmt.Errorf("awssqs.WithWaitTime(%v): must be whole seconds from 0s to 20s", d)
		}
		o.waitTime = d
		return nil
	}
}

// WithMaxMessages sets the most messages one ReceiveMessage call asks for
// (Capabilities.MaxReceive), from 1 to 10. Default 10.
func WithMaxMessages(n int) Option {
	return func(o *options) error {
		if n < 1 || n > 10 {
			return fmt.Errorf("awssqs.WithMaxMessages(%d): must be from 1 to 10", n)
		}
		o.maxMessages = n
		return nil
	}
}

// WithPollers sets how many ReceiveMessage calls the runtime may have in
// flight at once (Capabilities.Receivers), at least 1. Default 8
// (DefaultPollers) on a standard queue, 1 on a FIFO queue: one poll at a
// time hands each group's messages out in order by construction. More
// pollers on a FIFO queue rely on SQS's promise that it returns no further
// message of a group while one is in flight (real SQS keeps it; the test
// emulator does not).
//
// Each poll asks only for what the runtime has room for (WithConcurrency,
// WithMaxInFlight). Concurrent polls keep receives full while earlier
// batches are handled (on the emulator one poller tops out near 800 msg/s);
// on a queue without a backlog they cost more empty receives.
func WithPollers(n int) Option {
	return func(o *options) error {
		if n < 1 {
			return fmt.Errorf("awssqs.WithPollers(%d): must be at least 1", n)
		}
		o.pollers = n
		return nil
	}
}

// WithVisibilityTimeout sets the visibility timeout of received messages (the
// lease), in whole seconds from 1 s to 12 h; every ReceiveMessage call asks
// for it. Default: the queue's own VisibilityTimeout attribute, read when the
// Source is created. The runtime renews the lease at a third of it.
func WithVisibilityTimeout(d time.Duration) Option {
	return func(o *options) error {
		if !wholeSeconds(d, time.Second, MaxLeaseAge) {
			return fmt.Errorf("awssqs.WithVisibilityTimeout(%v): must be whole seconds from 1s to 12h", d)
		}
		o.visibility = d
		return nil
	}
}

// WithMessageAttributes names the message attributes to receive. Default
// "All". The W3C trace context attributes (traceparent, tracestate) are
// needed for trace propagation; name them when you restrict the list.
func WithMessageAttributes(names ...string) Option {
	return func(o *options) error {
		if len(names) == 0 {
			return fmt.Errorf("awssqs.WithMessageAttributes(): name at least one attribute (or \"All\")")
		}
		o.attributeNames = append([]string(nil), names...)
		return nil
	}
}

// WithAckLinger sets how long the runtime may hold a finished message's
// delete to fill a DeleteMessageBatch of ten (Capabilities.Ack.Linger), from 0
// to 1 s. Default 20 ms: under load ten deletes gather in far less, and
// under light load a message stays invisible (and renewed) at most that much
// longer. Zero sends whatever is ready at once.
func WithAckLinger(d time.Duration) Option {
	return lingerOption("WithAckLinger", d, func(o *options) { o.ackLinger = d })
}

// WithNackLinger sets how long the runtime may hold a nack to fill a
// ChangeMessageVisibilityBatch of ten (Capabilities.Nack.Linger), from 0 to
// 1 s. Default 10 ms: handlers fail one message at a time, and without the
// linger every retry would cost a request of its own. Zero sends whatever
// is ready at once.
func WithNackLinger(d time.Duration) Option {
	return lingerOption("WithNackLinger", d, func(o *options) { o.nackLinger = d })
}

func lingerOption(name string, d time.Duration, set func(*options)) Option {
	return func(o *options) error {
		if d < 0 || d > time.Second {
			return fmt.Errorf("awssqs.%s(%v): must be from 0s to 1s", name, d)
		}
		set(o)
		return nil
	}
}

// wholeSeconds reports whether d is whole seconds from lo to hi, as SQS
// takes waits and visibility timeouts.
func wholeSeconds(d, lo, hi time.Duration) bool {
	return d >= lo && d <= hi && d%time.Second == 0
}

// WithMeterProvider sets where the Source's metrics go (see the package
// documentation, section Telemetry). Default: the global OpenTelemetry
// MeterProvider.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(o *options) error {
		if mp == nil {
			return fmt.Errorf("awssqs.WithMeterProvider(nil): pass a MeterProvider, or leave the option out for the global one")
		}
		o.meterProvider = mp
		return nil
	}
}
