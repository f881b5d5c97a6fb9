package redisstream

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/adaptertest"
)

func TestConformance(t *testing.T) {
	adaptertest.Run(t, adaptertest.Harness{NewQueue: newConformanceQueue})
}

// newConformanceQueue makes a stream with its group and a dead-letter stream
// beside it. Leases are half what the suite asks for (at least 200 ms): a
// renewal is a local round trip, so a third of that leaves ample room on a
// loaded machine, and the suite's quiet periods, which run past the lease,
// stay short.
func newConformanceQueue(t *testing.T, cfg adaptertest.QueueConfig) *adaptertest.Queue {
	if cfg.Ordered {
		t.Skip("a consumer group promises no order: it hands one stream's entries to many consumers, and reclaims hand some out again later")
	}
	e := newEnv(t)
	lease := max(200*time.Millisecond, (cfg.Lease / 2).Truncate(time.Millisecond))
	if cfg.Lease == 0 {
		lease = time.Second
	}
	dlq, err := NewDeadLetter(e.ctx(), e.client, e.dlq)
	if err != nil {
		t.Fatal(err)
	}
	return &adaptertest.Queue{
		Lease: lease,
		Publish: func(ctx context.Context, msgs ...adaptertest.Message) error {
			pipe := e.client.Pipeline()
			for _, m := range msgs {
				fields := []string{DefaultBodyField, string(m.Body)}
				for k, v := range m.Headers {
					fields = append(fields, k, v)
				}
				pipe.XAdd(ctx, &redis.XAddArgs{Stream: e.stream, Values: fields})
			}
			_, err := pipe.Exec(ctx)
			return err
		},
		Open: func(t *testing.T) adapters.Source {
			return e.open(WithLease(lease), WithReclaimInterval(lease/4))
		},
		DeadLetter: dlq,
		DeadLettered: func(ctx context.Context) ([]adaptertest.Message, error) {
			ms, err := e.client.XRange(ctx, e.dlq, "-", "+").Result()
			if err != nil {
				return nil, err
			}
			out := make([]adaptertest.Message, len(ms))
			for i, m := range ms {
				out[i] = copyMessage(m)
			}
			return out, nil
		},
	}
}

// copyMessage reads a dead-letter copy back as the message it was: the body
// field is the body, every other field a header.
func copyMessage(m redis.XMessage) adaptertest.Message {
	msg := adaptertest.Message{Headers: map[string]string{}}
	for k, v := range m.Values {
		s, _ := v.(string)
		if k == DefaultBodyField {
			msg.Body = []byte(s)
			continue
		}
		msg.Headers[k] = s
	}
	return msg
}
