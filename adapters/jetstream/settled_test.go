package jetstream

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// hiddenSettler wraps a dead-letter destination as a user's wrapper would
// (one that logs its writes, say): only Send shows, so the runtime cannot
// learn that the destination settles the original, and acks it.
type hiddenSettler struct {
	dl    adapters.DeadLetter
	sends atomic.Int64
}

func (h *hiddenSettler) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	err := h.dl.Send(ctx, d, f)
	if err == nil {
		h.sends.Add(1)
	}
	return err
}

// TestAckAndNackOfDeadLetteredDelivery: after each of the package's
// dead-letter destinations settled a delivery (NewDeadLetter's term,
// NativeDeadLetter's term on a permanent error, its nak at the last
// delivery MaxDeliver allows), an Ack and a Nack of it succeed and send
// nothing: the server delivers the message no more, and a request could
// only act on it again.
func TestAckAndNackOfDeadLetteredDelivery(t *testing.T) {
	for _, tc := range []struct {
		name       string
		maxDeliver int
		sink       func(t *testing.T, e *env, src *Source, stream string) adapters.DeadLetter
		terms      int64
		naks       int64
	}{
		{"copy", -1, func(t *testing.T, e *env, src *Source, stream string) adapters.DeadLetter {
			e.stream(stream+"_dlq", false)
			dl, err := NewDeadLetter(e.ctx(), e.js, stream+"_dlq.copies")
			if err != nil {
				t.Fatal(err)
			}
			return dl
		}, 1, 0},
		{"native-term", 3, func(t *testing.T, e *env, src *Source, stream string) adapters.DeadLetter {
			dl, err := src.NativeDeadLetter(3)
			if err != nil {
				t.Fatal(err)
			}
			return dl
		}, 1, 0},
		{"native-maxdeliver", 1, func(t *testing.T, e *env, src *Source, stream string) adapters.DeadLetter {
			dl, err := src.NativeDeadLetter(1)
			if err != nil {
				t.Fatal(err)
			}
			return dl
		}, 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			name := uniqueName(t)
			e.stream(name, false)
			e.publish(name+".a", []byte("poison"), nil)
			opts := []Option{WithCreate(jetstream.ConsumerConfig{AckWait: 30 * time.Second, MaxDeliver: tc.maxDeliver})}
			if tc.maxDeliver > 0 {
				opts = append(opts, WithMaxAttempts(tc.maxDeliver))
			}
			src, err := New(e.ctx(), e.js, name, "settled", opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer src.Close()
			dl := tc.sink(t, e, src, name)
			d := receiveN(t, src, 1)[0]
			f := adapters.Failure{Err: consumer.Permanent(errors.New("malformed")), Permanent: true, Attempts: 1}
			if err := dl.Send(e.ctx(), d, f); err != nil {
				t.Fatalf("Send: %v", err)
			}
			ctx := e.ctx()
			if err := src.Ack(ctx, []*adapters.Delivery{d}); err != nil {
				t.Errorf("Ack after the dead letter settled the delivery: %v, want nil", err)
			}
			if err := src.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, time.Second)); err != nil {
				t.Errorf("Nack after the dead letter settled the delivery: %v, want nil", err)
			}
			if err := src.Ack(ctx, []*adapters.Delivery{d}); err != nil {
				t.Errorf("a second Ack: %v, want nil", err)
			}
			st := src.Stats()
			if st.Acks != 0 || st.Terms != tc.terms || st.Naks != tc.naks {
				t.Errorf("requests sent: %d acks, %d terms, %d naks; want only the dead letter's (%d terms, %d naks)", st.Acks, st.Terms, st.Naks, tc.terms, tc.naks)
			}
		})
	}
}

// TestDeadLetterBehindAWrapper runs poison messages through each
// destination wrapped so that the runtime cannot see it settles the
// original: the runtime acks them, and those acks must succeed without a
// request (custody.ack.failures stays at zero, the server sees no ack), the
// messages leave the consumer, and none is handled again.
func TestDeadLetterBehindAWrapper(t *testing.T) {
	for _, native := range []bool{false, true} {
		t.Run(map[bool]string{false: "copy", true: "native"}[native], func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			name := uniqueName(t)
			e.stream(name, false)
			advisories := make(chan *nats.Msg, 16)
			sub, err := e.nc.ChanSubscribe("$JS.EVENT.ADVISORY.CONSUMER.*."+name+".wrapped", advisories)
			if err != nil {
				t.Fatal(err)
			}
			defer sub.Unsubscribe()
			e.publish(name+".a", []byte("retried"), nil)
			e.publish(name+".a", []byte("permanent"), nil)
			src, err := New(e.ctx(), e.js, name, "wrapped", WithCreate(jetstream.ConsumerConfig{AckWait: 5 * time.Second, MaxDeliver: 3}),
				WithMaxAttempts(3), WithPollWait(200*time.Millisecond))
			if err != nil {
				t.Fatal(err)
			}
			var dl adapters.DeadLetter
			if native {
				dl, err = src.NativeDeadLetter(3)
			} else {
				e.stream(name+"_dlq", false)
				dl, err = NewDeadLetter(e.ctx(), e.js, name+"_dlq.copies")
			}
			if err != nil {
				t.Fatal(err)
			}
			wrapped := &hiddenSettler{dl: dl}
			if _, ok := adapters.DeadLetter(wrapped).(adapters.OriginalSettler); ok {
				t.Fatal("the wrapper shows OriginalSettler")
			}
			reader := sdkmetric.NewManualReader()
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
			defer mp.Shutdown(context.Background())
			var calls atomic.Int64
			h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				calls.Add(1)
				if string(m.Body) == "permanent" {
					return consumer.Permanent(errors.New("malformed"))
				}
				return errors.New("fails")
			})
			var maxDeliveries bool
			runUntil(t, src, h, "both messages dead-lettered and out of the consumer", func() bool {
				for len(advisories) > 0 {
					if m := <-advisories; strings.Contains(m.Subject, "MAX_DELIVERIES") {
						maxDeliveries = true
					}
				}
				if wrapped.sends.Load() != 2 || (native && !maxDeliveries) {
					return false
				}
				ci, err := src.cons.Info(e.ctx())
				return err == nil && ci.NumAckPending == 0 && ci.NumPending == 0
			}, consumer.WithDeadLetter(wrapped), consumer.WithMeterProvider(mp),
				consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(10 * time.Millisecond)}))
			if n := ackFailures(t, reader); n != 0 {
				t.Errorf("custody.ack.failures = %d: the runtime's acks of dead-lettered messages failed", n)
			}
			if st := src.Stats(); st.Acks != 0 || st.AcksFailed != 0 {
				t.Errorf("%d acks sent (%d failed): the dead letter had settled the messages; nothing should be sent", st.Acks, st.AcksFailed)
			}
			if n := calls.Load(); n != 4 {
				t.Errorf("%d handler calls, want 4 (3 attempts and 1)", n)
			}
		})
	}
}
