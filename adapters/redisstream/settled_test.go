package redisstream

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// hiddenSettler wraps a dead-letter destination as a user's wrapper would
// (one that logs its writes, say): only Send shows, so the runtime cannot
// learn that the destination acknowledges the original, and acks it.
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

// TestAckAndNackOfDeadLetteredEntry: once the DeadLetter stored an entry's
// copy and acknowledged it in one script, an Ack, a Nack and a renewal of
// the entry succeed and send nothing. A give-back found the entry no longer
// pending and failed with a lost lease; an XACK, harmless on its own, would
// acknowledge the entry's next delivery if the group were created again
// and read it anew.
func TestAckAndNackOfDeadLetteredEntry(t *testing.T) {
	e := newEnv(t)
	e.publish("poison")
	src := e.open()
	defer src.Close()
	dlq, err := NewDeadLetter(e.ctx(), e.client, e.dlq)
	if err != nil {
		t.Fatal(err)
	}
	d := receiveN(t, src, 1)[0]
	if err := dlq.Send(e.ctx(), d, adapters.Failure{Err: errors.New("bad"), Attempts: 1}); err != nil {
		t.Fatalf("Send: %v", err)
	}
	// The runtime neither acks nor nacks an entry whose dead letter says it
	// settled it: the Source must not keep it among those a lost group
	// would report.
	src.mu.Lock()
	held := len(src.held)
	src.mu.Unlock()
	if held != 0 {
		t.Errorf("the Source still holds %d entries after the dead letter acknowledged its only one", held)
	}
	before := src.Stats()
	ctx := e.ctx()
	if err := src.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, time.Second)); err != nil {
		t.Errorf("Nack after the dead letter acknowledged the entry: %v, want nil", err)
	}
	if err := src.Extend(ctx, []*adapters.Delivery{d}, src.Capabilities().Lease); err != nil {
		t.Errorf("Extend after the dead letter acknowledged the entry: %v, want nil", err)
	}
	if err := src.Ack(ctx, []*adapters.Delivery{d}); err != nil {
		t.Errorf("Ack after the dead letter acknowledged the entry: %v, want nil", err)
	}
	if after := src.Stats(); after.Commands() != before.Commands() {
		t.Errorf("%d commands sent for an entry the dead letter had acknowledged (stats %+v), want none", after.Commands()-before.Commands(), after)
	}
	if p := e.pending(); len(p) != 0 {
		t.Errorf("entries pending after the dead letter: %+v", p)
	}
	if n, _ := e.client.XLen(e.ctx(), e.dlq).Result(); n != 1 {
		t.Errorf("dead-letter stream holds %d entries, want 1", n)
	}
}

// TestDeadLetterBehindAWrapper runs a poison entry and one failing for good
// through the DeadLetter wrapped so that the runtime cannot see it
// acknowledges the originals: the runtime acks them, and those acks must
// succeed without an XACK (custody.ack.failures stays at zero), with each
// entry in the dead-letter stream once and nothing pending.
func TestDeadLetterBehindAWrapper(t *testing.T) {
	const lease = 500 * time.Millisecond
	e := newEnv(t)
	e.publish("poison", "permanent")
	dlq, err := NewDeadLetter(e.ctx(), e.client, e.dlq)
	if err != nil {
		t.Fatal(err)
	}
	wrapped := &hiddenSettler{dl: dlq}
	if _, ok := adapters.DeadLetter(wrapped).(adapters.OriginalSettler); ok {
		t.Fatal("the wrapper shows OriginalSettler")
	}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	var calls atomic.Int64
	src := e.open(WithLease(lease), WithReclaimInterval(20*time.Millisecond))
	s := start(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		calls.Add(1)
		if string(m.Body) == "permanent" {
			return consumer.Permanent(errors.New("malformed"))
		}
		return errors.New("cannot parse")
	}), consumer.WithDeadLetter(wrapped), consumer.WithMeterProvider(mp),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(10 * time.Millisecond)}))
	waitFor(t, "both entries dead-lettered", func() bool { return wrapped.sends.Load() == 2 })
	waitFor(t, "nothing pending", func() bool { return len(e.pending()) == 0 })
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n := sumBy(collect(t, reader)["custody.ack.failures"], "", ""); n != 0 {
		t.Errorf("custody.ack.failures = %d: the runtime's acks of dead-lettered entries failed", n)
	}
	if st := src.Stats(); st.Acks != 0 {
		t.Errorf("%d XACKs sent (stats %+v): the dead letter had acknowledged the entries; nothing should be sent", st.Acks, st)
	}
	if n, _ := e.client.XLen(e.ctx(), e.dlq).Result(); n != 2 {
		t.Errorf("dead-letter stream holds %d entries, want 2", n)
	}
	if n := calls.Load(); n != 4 {
		t.Errorf("%d handler calls, want 4 (3 attempts and 1)", n)
	}
}
