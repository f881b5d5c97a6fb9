package consumer_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
)

// queuedSource is a memory source that declares, like Kafka by key, that
// deliveries queued behind their lane cost the broker nothing
// (FreeWhileQueued, no lease, maxUnacked), or, with free false, keeps the
// memory broker's lease. It hands out as many deliveries as it is asked
// for, whatever its MaxUnacked, and records the most it had handed out and
// not yet acked or nacked: the runtime's bounds alone keep that down.
type queuedSource struct {
	boundedSource
	free       bool
	maxUnacked int
}

func (s *queuedSource) Capabilities() adapters.Capabilities {
	c := s.Source.Capabilities()
	if s.free {
		c.Lease = 0
		c.MaxUnacked = s.maxUnacked
		c.FreeWhileQueued = true
	}
	return c
}

func (s *queuedSource) heldNow() (held, peak int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.held, s.peak
}

// slowKeyRun publishes one message of key "slow", then 30 more of it
// interleaved with 20 of five other keys, and runs a consumer (by key, 2
// workers, a window of 4) over src whose handler blocks the first "slow"
// message until release is closed.
type slowKeyRun struct {
	mu      sync.Mutex
	handled map[string][]string // bodies by key, in handling order
	others  int
	release chan struct{}
	once    sync.Once
	r       *running
}

const slowKeyRest, otherKeys, otherCount = 30, 5, 20

func startSlowKey(t *testing.T, e *env, src adapters.Source) *slowKeyRun {
	e.publishKeyed("slow", "slow-00")
	for i := 1; i <= slowKeyRest; i++ {
		e.publishKeyed("slow", fmt.Sprintf("slow-%02d", i))
		if i <= otherCount {
			k := fmt.Sprintf("k%d", i%otherKeys)
			e.publishKeyed(k, fmt.Sprintf("%s-%02d", k, i))
		}
	}
	s := &slowKeyRun{handled: map[string][]string{}, release: make(chan struct{})}
	started := make(chan struct{})
	s.r = runOn(t, src, func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "slow-00" {
			close(started)
			<-s.release
		}
		s.mu.Lock()
		s.handled[m.Key] = append(s.handled[m.Key], string(m.Body))
		if m.Key != "slow" {
			s.others++
		}
		s.mu.Unlock()
		return nil
	}, consumer.WithOrdering(consumer.OrderByKey), consumer.WithConcurrency(2), consumer.WithMaxInFlight(4))
	t.Cleanup(s.unblock) // before the consumer stops, should the test fail first
	await(t, "the slow key's first message to start", started)
	return s
}

func (s *slowKeyRun) unblock() { s.once.Do(func() { close(s.release) }) }

func (s *slowKeyRun) handledOthers() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.others
}

// finish releases the slow message, waits for every message to be acked,
// and checks each was handled once, in its key's order.
func (s *slowKeyRun) finish(t *testing.T, e *env) {
	t.Helper()
	s.unblock()
	total := 1 + slowKeyRest + otherCount
	waitFor(t, "every message acked", func() bool { return e.stats("q").Acked == int64(total) })
	if err := s.r.stop(); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for k, bodies := range s.handled {
		n += len(bodies)
		for i := 1; i < len(bodies); i++ {
			if bodies[i] <= bodies[i-1] {
				t.Errorf("key %s: %s handled after %s", k, bodies[i], bodies[i-1])
			}
		}
	}
	if n != total {
		t.Errorf("%d handler calls, want %d, one per message", n, total)
	}
}

// Where the source's queued deliveries cost the broker nothing, the
// messages of a key queued behind its running one stay out of the
// in-flight window: while the key's first message runs on, its 30 later
// ones wait, and every other key's message is handled, through a window of
// 4. The source's MaxUnacked bounds what the runtime holds instead.
func TestSlowKeyHoldsUpItsOwnKeyOnlyWhereQueuedDeliveriesAreFree(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	src := &queuedSource{boundedSource: boundedSource{Source: e.source()}, free: true, maxUnacked: 100}
	s := startSlowKey(t, e, src)
	waitFor(t, "every other key's message handled while the slow one runs", func() bool {
		return s.handledOthers() == otherCount
	})
	s.finish(t, e)
	if _, peak := src.heldNow(); peak > src.maxUnacked {
		t.Fatalf("the runtime held %d deliveries at once, above the source's MaxUnacked %d", peak, src.maxUnacked)
	}
}

// The deliveries queued behind their lanes are bounded, with everything
// else the runtime holds, by the source's MaxUnacked, which the runtime
// keeps to itself: this source would hand out all it was asked for.
func TestFreeQueuedDeliveriesAreBoundedByMaxUnacked(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	src := &queuedSource{boundedSource: boundedSource{Source: e.source()}, free: true, maxUnacked: 10}
	s := startSlowKey(t, e, src)
	waitFor(t, "the runtime to hold near MaxUnacked", func() bool {
		held, _ := src.heldNow()
		return held >= src.maxUnacked-1
	})
	time.Sleep(100 * time.Millisecond) // room for the runtime to take more, wrongly
	if _, peak := src.heldNow(); peak > src.maxUnacked {
		t.Fatalf("the runtime held %d deliveries at once, above the source's MaxUnacked %d", peak, src.maxUnacked)
	}
	s.finish(t, e)
}

// A leased delivery waiting behind its lane holds a lease the runtime
// renews, so it stays in the in-flight window: the runtime never holds more
// than the window, and the slow key's queued messages fill it (to 3 of 4 at
// least: the receiver waits for room for a batch of 2).
func TestLeasedQueuedDeliveriesStayInTheWindow(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	src := &queuedSource{boundedSource: boundedSource{Source: e.source()}}
	s := startSlowKey(t, e, src)
	waitFor(t, "the window to fill", func() bool {
		held, _ := src.heldNow()
		return held >= 3
	})
	time.Sleep(100 * time.Millisecond) // room for the runtime to take more, wrongly
	if _, peak := src.heldNow(); peak > 4 {
		t.Fatalf("the runtime held %d deliveries at once, above WithMaxInFlight(4)", peak)
	}
	if n := s.handledOthers(); n == otherCount {
		t.Fatalf("all %d messages of the other keys handled through a window the slow key's queued messages fill", n)
	}
	s.finish(t, e)
}

// FreeWhileQueued says queued deliveries cost the broker nothing and
// MaxUnacked bounds them: New refuses a source that declares it with a
// lease, a maximum lease age or no MaxUnacked.
func TestFreeWhileQueuedNeedsNoLeaseAndMaxUnacked(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	for _, caps := range []adapters.Capabilities{
		{Lease: time.Minute, MaxUnacked: 10},
		{MaxLeaseAge: time.Hour, MaxUnacked: 10},
		{},
	} {
		caps.Name, caps.FreeWhileQueued = "free", true
		_, err := consumer.New(capsSource{Source: e.source(), caps: caps}, h)
		if err == nil || !strings.Contains(err.Error(), "FreeWhileQueued") {
			t.Errorf("New with %+v: %v, want an error naming FreeWhileQueued", caps, err)
		}
	}
	caps := adapters.Capabilities{Name: "free", MaxUnacked: 10, FreeWhileQueued: true}
	if _, err := consumer.New(capsSource{Source: e.source(), caps: caps}, h); err != nil {
		t.Errorf("New with %+v: %v", caps, err)
	}
}

// capsSource is a memory source with the given capabilities.
type capsSource struct {
	*memory.Source
	caps adapters.Capabilities
}

func (s capsSource) Capabilities() adapters.Capabilities { return s.caps }
