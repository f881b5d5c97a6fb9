package redisstream

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

const meterName = "github.com/custody-go/custody/adapters/redisstream"

// The commands a Source sends, as counted in Stats and metrics. The scripts
// count as one command each: one round trip, one EVALSHA.
const (
	cmdRead    = iota // XREADGROUP
	cmdReclaim        // the reclaim script (XAUTOCLAIM, XCLAIM)
	cmdAck            // XACK
	cmdDelete         // XDEL, with WithDeleteOnAck
	cmdExtend         // the renewal script
	cmdNack           // the give-back script
	cmdCleanup        // the consumer clean-up script
	cmdInfo           // XINFO GROUPS for the backlog gauges, and the backlog script
	cmdCount
)

var cmdNames = [cmdCount]string{"xreadgroup", "reclaim", "xack", "xdel", "renew", "nack", "cleanup", "xinfo"}

// infoTimeout bounds the XINFO GROUPS call behind the backlog gauges.
const infoTimeout = 2 * time.Second

// telemetry holds the Source's instruments, whose descriptions say what
// each counts. All carry messaging.destination.name (the stream) and
// messaging.consumer.group.name (the group); custody.redis.commands also
// custody.redis.command (cmdNames) and error. The gauges ask the server
// (XINFO GROUPS) when the metrics are collected; lag is left out when Redis
// cannot tell (after deletions in the range).
type telemetry struct {
	commands     metric.Int64Counter
	reclaimed    metric.Int64Counter
	deleted      metric.Int64Counter
	groupMissing metric.Int64Counter
	reg          metric.Registration
	base         metric.MeasurementOption
	attrs        [cmdCount][2]metric.AddOption
}

func newTelemetry(mp metric.MeterProvider, s *Source) (*telemetry, error) {
	m := mp.Meter(meterName)
	stream := attribute.String("messaging.destination.name", s.stream)
	group := attribute.String("messaging.consumer.group.name", s.group)
	t := &telemetry{base: metric.WithAttributes(stream, group)}
	for c := range cmdCount {
		for i, failed := range []bool{false, true} {
			t.attrs[c][i] = metric.WithAttributes(stream, group,
				attribute.String("custody.redis.command", cmdNames[c]), attribute.Bool("error", failed))
		}
	}
	var err error
	if t.commands, err = m.Int64Counter("custody.redis.commands", metric.WithUnit("{command}"),
		metric.WithDescription("Commands sent to Redis: reads, reclaims, acks, deletes, renewals, give-backs (a script counts as one).")); err != nil {
		return nil, err
	}
	if t.reclaimed, err = m.Int64Counter("custody.redis.reclaimed", metric.WithUnit("{message}"),
		metric.WithDescription("Pending entries claimed once idle for the lease: a dead consumer's, or a retry that fell due.")); err != nil {
		return nil, err
	}
	if t.deleted, err = m.Int64Counter("custody.redis.deleted", metric.WithUnit("{message}"),
		metric.WithDescription("Pending entries found deleted from the stream (trimmed, XDEL).")); err != nil {
		return nil, err
	}
	if t.groupMissing, err = m.Int64Counter("custody.redis.group_missing", metric.WithUnit("{event}"),
		metric.WithDescription("Times the consumer group was found missing (stream deleted, or server data lost).")); err != nil {
		return nil, err
	}
	pending, err := m.Int64ObservableGauge("custody.redis.pending", metric.WithUnit("{message}"),
		metric.WithDescription("Entries in the consumer group's pending list, all consumers together."))
	if err != nil {
		return nil, err
	}
	lag, err := m.Int64ObservableGauge("custody.redis.lag", metric.WithUnit("{message}"),
		metric.WithDescription("Entries of the stream not yet delivered to the consumer group."))
	if err != nil {
		return nil, err
	}
	t.reg, err = m.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		ctx, cancel := context.WithTimeout(ctx, infoTimeout)
		defer cancel()
		p, l, err := s.groupInfo(ctx)
		if err != nil {
			return nil // nothing to report; the command counter shows the failure
		}
		o.ObserveInt64(pending, p, t.base)
		if l >= 0 {
			o.ObserveInt64(lag, l, t.base)
		}
		return nil
	}, pending, lag)
	if err != nil {
		return nil, err
	}
	return t, nil
}

func (t *telemetry) close() {
	if t.reg != nil {
		_ = t.reg.Unregister()
	}
}

// count counts a command sent; failed counts one that failed.
func (s *Source) count(c int) {
	s.stats.commands[c].Add(1)
	if s.tel != nil {
		s.tel.commands.Add(context.Background(), 1, s.tel.attrs[c][0])
	}
}

func (s *Source) failed(c int) {
	s.stats.failures[c].Add(1)
	if s.tel != nil {
		s.tel.commands.Add(context.Background(), 1, s.tel.attrs[c][1])
	}
}

// groupInfo asks the server (XINFO GROUPS) for the group's pending count
// and lag (-1 when Redis cannot tell), for the gauges.
func (s *Source) groupInfo(ctx context.Context) (pending, lag int64, err error) {
	s.count(cmdInfo)
	sent := time.Now()
	groups, err := s.client.XInfoGroups(ctx, s.stream).Result()
	s.conn.observe(sent, err)
	if err != nil {
		s.failed(cmdInfo)
		return 0, 0, err
	}
	for _, g := range groups {
		if g.Name == s.group {
			return g.Pending, g.Lag, nil
		}
	}
	return 0, 0, ErrGroupMissing
}
