package adapters

import (
	"context"
	"time"
)

// ConnState is the state of a source's connection to its broker.
type ConnState int

const (
	// Connecting: the first connection is being made.
	Connecting ConnState = iota
	// Connected: the source reaches its broker.
	Connected
	// Reconnecting: the connection was lost and is being made again.
	Reconnecting
	// Disconnected: the source was closed.
	Disconnected
)

func (s ConnState) String() string {
	switch s {
	case Connecting:
		return "connecting"
	case Connected:
		return "connected"
	case Reconnecting:
		return "reconnecting"
	case Disconnected:
		return "disconnected"
	}
	return "unknown"
}

// Connection is what a source tells of its connection to the broker.
type Connection struct {
	State ConnState
	// Since is when the connection entered State.
	Since time.Time
	// LastError is the last error of a connection attempt while not
	// connected; nil once connected.
	LastError error
}

// Connector is implemented by sources that hold a connection to their
// broker (RabbitMQ, Kafka, NATS, Redis): the runtime reports it in its
// health and readiness. A source without one (SQS speaks plain HTTP
// requests) is taken as connected once a Receive returned without error.
type Connector interface {
	Connection() Connection
}

// Backlog is the number of messages waiting for a source's consumers, as
// the broker counts them. Fields the broker does not tell are -1 (counts)
// or zero (the age).
type Backlog struct {
	// Waiting is the messages ready to be received: SQS
	// ApproximateNumberOfMessages, a RabbitMQ queue's ready messages, a
	// Kafka group's lag, a JetStream consumer's pending messages.
	Waiting int64
	// InFlight is the messages received and not yet settled, where the
	// broker counts them: SQS ApproximateNumberOfMessagesNotVisible,
	// RabbitMQ's unacked messages, JetStream's ack-pending messages.
	InFlight int64
	// OldestAge is the age of the oldest waiting message, where the broker
	// tells it.
	OldestAge time.Duration
}

// BacklogReporter is implemented by sources that can ask their broker for
// their backlog. The runtime asks at a low rate (see consumer's
// WithBacklogInterval) and reports it as gauges.
type BacklogReporter interface {
	Backlog(ctx context.Context) (Backlog, error)
}

// Pauser is implemented by sources that fetch ahead of Receive on their
// own (a Kafka client's fetches): the runtime tells them when the consumer
// stops intake (Pause, or a tripped kill switch), so that they stop
// fetching without giving up what they hold (a paused Kafka partition stays
// assigned), and when intake starts again. Calls are serialised and
// alternate: Pause, then Resume, then Pause.
type Pauser interface {
	Pause()
	Resume()
}

// Assigner is implemented by sources whose share of the stream changes
// under them (a Kafka group member's partitions): the runtime reports the
// current assignment in its health.
type Assigner interface {
	Assigned() []string
}
