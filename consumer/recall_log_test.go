package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// logSource is a partitioned log handed out ahead, as the Kafka adapter
// does: each partition's records go out in offset order, up to ahead of
// them unsettled. A revoke recalls a partition's handed-out records, the
// latest first, waits for them all to be settled and then starts again
// from the first record not done (the committed prefix), as the
// partition's next owner would.
type logSource struct {
	recalls chan struct{}
	ahead   int

	mu    sync.Mutex
	parts []*logPart
	wake  chan struct{}
}

type logPart struct {
	id        int
	n         int64
	next      int64 // the next offset to hand out
	done      []bool
	out       []*adapters.Delivery // handed out and unsettled, in order
	revoking  bool
	revokeEnd chan struct{}
	epoch     int
}

type logHandle struct {
	p     *logPart
	epoch int
}

func newLogSource(parts int, n int64, ahead int) *logSource {
	s := &logSource{recalls: make(chan struct{}, 1), ahead: ahead, wake: make(chan struct{}, 1)}
	for i := 0; i < parts; i++ {
		s.parts = append(s.parts, &logPart{id: i, n: n, done: make([]bool, n)})
	}
	return s
}

func (s *logSource) Recalls() <-chan struct{} { return s.recalls }

func (s *logSource) Capabilities() adapters.Capabilities {
	return adapters.Capabilities{Name: "log", System: "log", Ordered: true}
}

func (s *logSource) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	for {
		s.mu.Lock()
		var out []*adapters.Delivery
		for _, p := range s.parts {
			for !p.revoking && p.next < p.n && len(p.out) < s.ahead && len(out) < max {
				o := p.next
				p.next++
				if p.done[o] {
					continue
				}
				d := &adapters.Delivery{
					Signal: new(adapters.Signal),
					ID:     fmt.Sprintf("%d/%d", p.id, o), Body: []byte(fmt.Sprint(o)),
					OrderingKey: fmt.Sprint("p", p.id), Partition: int32(p.id), Offset: o,
					ReceivedAt: time.Now(), Handle: logHandle{p, p.epoch},
				}
				p.out = append(p.out, d)
				out = append(out, d)
			}
		}
		s.mu.Unlock()
		if len(out) > 0 {
			return out, nil
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-s.wake:
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func (s *logSource) settle(ds []*adapters.Delivery, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range ds {
		h := d.Handle.(logHandle)
		p := h.p
		if h.epoch != p.epoch {
			continue // an earlier assignment's: refused
		}
		i := -1
		for k, x := range p.out {
			if x == d {
				i = k
			}
		}
		if i < 0 {
			continue
		}
		p.out = append(p.out[:i], p.out[i+1:]...)
		if ok {
			p.done[d.Offset] = true
		}
		if p.revoking && len(p.out) == 0 {
			s.reassignLocked(p)
		}
	}
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// reassignLocked starts p again from its first record not done.
func (s *logSource) reassignLocked(p *logPart) {
	p.revoking = false
	p.epoch++
	p.next = 0
	for p.next < p.n && p.done[p.next] {
		p.next++
	}
	close(p.revokeEnd)
}

func (s *logSource) Ack(_ context.Context, ds []*adapters.Delivery) error {
	s.settle(ds, true)
	return nil
}

func (s *logSource) Nack(_ context.Context, ns []adapters.Nack) error {
	ds := deliveriesOf(ns)
	s.settle(ds, false)
	return nil
}

func (s *logSource) Close() error { return nil }

// revoke recalls partition i's handed-out records, the latest first, and
// returns a channel closed once the partition starts again.
func (s *logSource) revoke(i int) <-chan struct{} {
	s.mu.Lock()
	p := s.parts[i]
	if p.revoking {
		ch := p.revokeEnd
		s.mu.Unlock()
		return ch
	}
	p.revoking = true
	p.revokeEnd = make(chan struct{})
	ch := p.revokeEnd
	for k := len(p.out) - 1; k >= 0; k-- {
		p.out[k].Signal.Recall()
	}
	if len(p.out) == 0 {
		s.reassignLocked(p)
	}
	s.mu.Unlock()
	select {
	case s.recalls <- struct{}{}:
	default:
	}
	return ch
}

func (s *logSource) allDone() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.parts {
		for _, d := range p.done {
			if !d {
				return false
			}
		}
	}
	return true
}

// Under random revokes of a log handed out far ahead, each partition's
// effects keep offset order: no record's effect happens before every
// earlier record of its partition had its effect. No running handler is
// cancelled by a recall.
func TestRecallsOfALogHandedOutAheadKeepPartitionOrder(t *testing.T) {
	const parts, n = 3, 200
	src := newLogSource(parts, n, 40)
	var mu sync.Mutex
	effected := make([][]bool, parts)
	for i := range effected {
		effected[i] = make([]bool, n)
	}
	var violations, cancelled atomic.Int64
	h := func(ctx context.Context, m *consumer.Message) error {
		if rand.IntN(3) == 0 {
			time.Sleep(time.Duration(rand.IntN(200)) * time.Microsecond)
		}
		if rand.IntN(10) == 0 {
			return errors.New("flaky")
		}
		if ctx.Err() != nil {
			cancelled.Add(1)
		}
		mu.Lock()
		defer mu.Unlock()
		p, o := m.Partition, m.Offset
		for k := int64(0); k < o; k++ {
			if !effected[p][k] {
				violations.Add(1)
				t.Errorf("partition %d: %d ran before %d", p, o, k)
				break
			}
		}
		effected[p][o] = true
		return nil
	}
	r := runOn(t, src, h, consumer.WithConcurrency(4), consumer.WithMaxInFlight(100),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 1000, Backoff: consumer.ConstantBackoff(200 * time.Microsecond)}))
	defer r.stop()
	stop := make(chan struct{})
	var revokes atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(rand.IntN(3000)) * time.Microsecond):
				ch := src.revoke(rand.IntN(parts))
				revokes.Add(1)
				select {
				case <-ch:
				case <-stop:
					return
				}
			}
		}
	}()
	waitFor(t, "every record done", src.allDone)
	close(stop)
	wg.Wait()
	if n := cancelled.Load(); n > 0 {
		t.Errorf("%d running handlers saw their context cancelled", n)
	}
	t.Logf("%d revokes", revokes.Load())
}
