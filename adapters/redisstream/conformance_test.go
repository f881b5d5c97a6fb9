package redisstream

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/adaptertest"
	"github.com/custody-go/custody/internal/testkit/testlog"
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
	var hooks sync.Map // *Source -> *cutHook
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
			// A client of its own, which Crash can cut.
			c := &cutHook{}
			client := redis.NewClient(e.client.Options())
			client.AddHook(c)
			t.Cleanup(func() { client.Close() })
			src, err := New(e.ctx(), client, e.stream, e.group, WithCreateGroup("0"), WithBlock(50*time.Millisecond),
				WithLogger(testlog.New(t)), WithLease(lease), WithReclaimInterval(lease/4))
			if err != nil {
				t.Fatal(err)
			}
			hooks.Store(src, c)
			return src
		},
		Crash: func(src adapters.Source) {
			c, ok := hooks.Load(src)
			if !ok {
				t.Fatalf("Crash: %T was not opened by this harness", src)
			}
			c.(*cutHook).cut.Store(true)
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

// cutHook cuts a client off from Redis, as the death of the process that
// holds it would: once cut is set, no command reaches Redis, and no
// connection is made; a command already sent is answered.
type cutHook struct{ cut atomic.Bool }

var errCut = errors.New("cut off from Redis by the conformance harness")

func (h *cutHook) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		if h.cut.Load() {
			return nil, errCut
		}
		return next(ctx, network, addr)
	}
}

func (h *cutHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.cut.Load() {
			cmd.SetErr(errCut)
			return errCut
		}
		return next(ctx, cmd)
	}
}

func (h *cutHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.cut.Load() {
			for _, cmd := range cmds {
				cmd.SetErr(errCut)
			}
			return errCut
		}
		return next(ctx, cmds)
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
