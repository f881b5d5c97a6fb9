package consumer_test

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
)

// A handler under test that calls t.FailNow (or testify's require) ends its
// goroutine with runtime.Goexit instead of returning. The message is given
// back and retried, the worker is replaced, and the run goes on and drains:
// it used to lose the worker for good, with the message held, so that a
// consumer of concurrency 1 stopped and Run never returned.
func TestHandlerCallingGoexitDoesNotStopTheConsumer(t *testing.T) {
	for _, fifo := range []bool{false, true} {
		t.Run(fmt.Sprintf("fifo=%v", fifo), func(t *testing.T) {
			e := newEnv(t, memory.QueueOptions{Lease: time.Minute, FIFO: fifo})
			var msgs []memory.Message
			for _, b := range []string{"x", "y", "z"} {
				msgs = append(msgs, memory.Message{Body: []byte(b), Key: "k"})
			}
			if err := e.b.Publish(context.Background(), "q", msgs...); err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var done []string
			r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
				if string(m.Body) == "x" && m.Attempt == 1 {
					runtime.Goexit()
				}
				mu.Lock()
				done = append(done, string(m.Body))
				mu.Unlock()
				return nil
			}, fastRetry(3))
			waitFor(t, "every message acked", func() bool { return e.stats("q").Acked == 3 })
			if err := r.stop(); err != nil {
				t.Fatalf("Run: %v", err)
			}
			mu.Lock()
			defer mu.Unlock()
			if !fifo {
				slices.Sort(done)
			}
			if want := []string{"x", "y", "z"}; !slices.Equal(done, want) {
				t.Fatalf("effects %v, want %v (in order on a FIFO queue)", done, want)
			}
		})
	}
}

// In at-most-once mode the message was acked on receipt: a handler ending
// with runtime.Goexit loses it, as any failure does in that mode, and the
// consumer goes on.
func TestHandlerCallingGoexitAtMostOnce(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("x", "y", "z")
	var mu sync.Mutex
	var done []string
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "x" {
			runtime.Goexit()
		}
		mu.Lock()
		done = append(done, string(m.Body))
		mu.Unlock()
		return nil
	}, consumer.WithAtMostOnceAckBeforeProcessingUnsafe())
	waitFor(t, "y and z handled", func() bool { mu.Lock(); defer mu.Unlock(); return len(done) == 2 })
	if err := r.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if st := e.stats("q"); st.Acked != 3 {
		t.Fatalf("stats %+v, want all three acked on receipt", st)
	}
}
