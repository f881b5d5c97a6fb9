package pgtx_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
)

// crashRun drains queue with processes consumers at once, each a consumer
// (made by newConsumer) over a Source of its own whose acks fail one time
// in twenty. Every 250 ms, for the first dozen times, one process dies
// holding its deliveries (its Source refuses everything, acks included) and
// a new one takes its place. It returns the failed acks and the crashes.
func crashRun(t *testing.T, ctx context.Context, broker *memory.Broker, queue string, processes int,
	newConsumer func(*memory.Source) (*consumer.Consumer, error)) (ackFaults, crashes int64) {
	t.Helper()
	var acks atomic.Int64
	faults := memory.Faults{Ack: func(*adapters.Delivery) error {
		if rand.N(20) == 0 {
			acks.Add(1)
			return errors.New("injected ack failure")
		}
		return nil
	}}
	type process struct {
		src    *memory.Source
		cancel context.CancelFunc
		done   chan error
	}
	start := func() *process {
		src, err := broker.Source(queue, memory.WithPollWait(50*time.Millisecond), memory.WithFaults(faults))
		if err != nil {
			t.Fatal(err)
		}
		c, err := newConsumer(src)
		if err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithCancel(ctx)
		p := &process{src: src, cancel: cancel, done: make(chan error, 1)}
		go func() { p.done <- c.Run(rctx) }()
		return p
	}
	stop := func(p *process) {
		p.cancel()
		select {
		case <-p.done:
		case <-time.After(60 * time.Second):
			t.Fatal("a consumer did not stop within 60s")
		}
	}
	var procs []*process
	for range processes {
		procs = append(procs, start())
	}
	drained := func() bool {
		st, err := broker.Stats(queue)
		if err != nil {
			t.Fatal(err)
		}
		return st.Visible == 0 && st.InFlight == 0
	}
	deadline := time.Now().Add(5 * time.Minute)
	for i := 0; !drained(); i++ {
		if time.Now().After(deadline) {
			st, _ := broker.Stats(queue)
			t.Fatalf("queue not drained after 5 minutes: %+v", st)
		}
		time.Sleep(20 * time.Millisecond)
		if i%12 == 11 && crashes < 12 {
			victim := procs[0]
			procs = append(procs[1:], start())
			victim.src.Crash()
			crashes++
			stop(victim)
		}
	}
	for _, p := range procs {
		stop(p)
	}
	return acks.Load(), crashes
}

// expectEachEffectOnce checks that the effect table holds exactly one row
// for each of n messages and the processed table n keys, and returns the
// sequential duplicates the handler absorbed.
func (f *fixture) expectEachEffectOnce(t *testing.T, ctx context.Context, n int) (sequential int64) {
	t.Helper()
	var rows, distinct int
	if err := f.pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT message_id) FROM `+f.effects).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	if rows != n || distinct != n {
		t.Fatalf("effect table has %d rows for %d distinct messages, want exactly %d", rows, distinct, n)
	}
	if k := f.rows(t, f.processed); k != n {
		t.Fatalf("processed table has %d keys, want %d", k, n)
	}
	return f.duplicates(t, "sequential")
}
