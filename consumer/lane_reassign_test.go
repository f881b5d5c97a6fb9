package consumer_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// reassignedPartition plays a Kafka partition taken from this consumer and
// assigned back to it while the handler of its first record still runs: the
// first Receive returns offset 0 of epoch 1; the next, once the test calls
// reassign, offsets 0 and 1 of epoch 2 (the first record's redelivery and
// the one after it); the one after that offsets 2 and 3, only once the
// runtime has run or given back one of epoch 2's records. Nacked records are
// fetched again first, as the Kafka adapter does.
type reassignedPartition struct {
	started    chan struct{} // closed when the first record's handler starts
	reassigned chan struct{} // closed by reassign
	thirdCall  chan struct{} // closed when the third Receive starts
	moved      chan struct{} // closed on the first Nack or epoch-2 handler call

	mu       sync.Mutex
	calls    int
	held     []*adapters.Delivery
	requeued []*adapters.Delivery
	acked    []string
	nacked   []string
	onceMove sync.Once
}

func newReassignedPartition() *reassignedPartition {
	return &reassignedPartition{
		started:    make(chan struct{}),
		reassigned: make(chan struct{}),
		thirdCall:  make(chan struct{}),
		moved:      make(chan struct{}),
	}
}

func (p *reassignedPartition) record(epoch, offset int) *adapters.Delivery {
	d := &adapters.Delivery{
		Signal:      new(adapters.Signal),
		ID:          fmt.Sprintf("p0/%d", offset),
		Body:        []byte(fmt.Sprintf("e%d/%d", epoch, offset)),
		OrderingKey: "p0",
		Attempt:     0,
		Partition:   0,
		Offset:      int64(offset),
		ReceivedAt:  time.Now(),
		Handle:      epoch,
	}
	p.held = append(p.held, d)
	return d
}

// reassign revokes epoch 1 (its records are lost) and assigns epoch 2.
func (p *reassignedPartition) reassign() {
	p.mu.Lock()
	held := p.held
	p.held = nil
	p.mu.Unlock()
	for _, d := range held {
		d.Signal.Lose(adapters.ErrRevoked)
	}
	close(p.reassigned)
}

func (p *reassignedPartition) move() { p.onceMove.Do(func() { close(p.moved) }) }

func (p *reassignedPartition) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	p.mu.Lock()
	p.calls++
	call := p.calls
	p.mu.Unlock()
	var wait <-chan struct{}
	switch call {
	case 1:
	case 2:
		wait = p.reassigned
	case 3:
		close(p.thirdCall)
		wait = p.moved
	default:
		// Only nacked records from here on: poll for them.
		select {
		case <-time.After(2 * time.Millisecond):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if wait != nil {
		select {
		case <-wait:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	switch call {
	case 1:
		return []*adapters.Delivery{p.record(1, 0)}, nil
	case 2:
		return []*adapters.Delivery{p.record(2, 0), p.record(2, 1)}, nil
	case 3:
		// Fetched before anything was nacked.
		return []*adapters.Delivery{p.record(2, 2), p.record(2, 3)}, nil
	}
	ds := p.requeued
	p.requeued = nil
	return ds, nil
}

func (p *reassignedPartition) Ack(_ context.Context, ds []*adapters.Delivery) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, d := range ds {
		p.acked = append(p.acked, string(d.Body))
	}
	return nil
}

func (p *reassignedPartition) Nack(_ context.Context, ns []adapters.Nack) error {
	ds := deliveriesOf(ns)
	p.mu.Lock()
	for _, d := range ds {
		p.nacked = append(p.nacked, string(d.Body))
		// The Kafka adapter hands a nacked record out again, the same
		// record in the same epoch.
		p.requeued = append(p.requeued, d)
	}
	p.mu.Unlock()
	p.move()
	return nil
}

func (p *reassignedPartition) Capabilities() adapters.Capabilities {
	return adapters.Capabilities{Name: "reassigned-partition", Ordered: true}
}

func (p *reassignedPartition) Close() error { return nil }

func (p *reassignedPartition) ackedBodies() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.acked)
}

// TestLaneLossRunsTheRedeliveryReceivedAfterIt: a partition is revoked while
// its first record's handler runs and assigned back to the same consumer,
// which receives the lost record again, and the one after it, queued in the
// lane behind the lost handler. Those two were received after the loss: they
// are the partition as the broker delivers it again and must run, in order,
// with the records fetched after them. Given back as if they were behind the
// lost record, they were fetched again after offsets 2 and 3, which then ran
// first: the partition's records ran in the order 2, 3, 0, 1.
func TestLaneLossRunsTheRedeliveryReceivedAfterIt(t *testing.T) {
	p := newReassignedPartition()
	var mu sync.Mutex
	var ran []string
	h := func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "e1/0" {
			close(p.started)
			<-p.thirdCall // epoch 2's first records are queued behind it
			<-ctx.Done()  // lost with its partition
			return context.Cause(ctx)
		}
		p.move()
		mu.Lock()
		ran = append(ran, string(m.Body))
		mu.Unlock()
		return nil
	}
	r := runOn(t, p, h, consumer.WithConcurrency(4))
	defer r.stop()
	<-p.started
	p.reassign()
	want := []string{"e2/0", "e2/1", "e2/2", "e2/3"}
	waitFor(t, "epoch 2's records acked", func() bool { return len(p.ackedBodies()) == len(want) })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(ran, want) {
		t.Fatalf("the partition's records ran in the order %v, want %v (nacked: %v)", ran, want, p.nacked)
	}
	if len(p.nacked) != 0 {
		t.Fatalf("nacked %v: records received after the loss were given back", p.nacked)
	}
}

// handedOverLost hands over, in one batch, a delivery it has already lost
// and the next one of its group, then nothing more.
type handedOverLost struct {
	mu     sync.Mutex
	calls  int
	nacked []string
}

func (s *handedOverLost) Receive(ctx context.Context, _ int) ([]*adapters.Delivery, error) {
	s.mu.Lock()
	s.calls++
	first := s.calls == 1
	s.mu.Unlock()
	if !first {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(5 * time.Millisecond):
			return nil, nil
		}
	}
	lost := &adapters.Delivery{Signal: new(adapters.Signal), ID: "a1", Body: []byte("a1"), OrderingKey: "a", Partition: -1, Offset: -1}
	lost.Signal.Lose(adapters.ErrLeaseLost) // its visibility ran out while it waited in the source
	next := &adapters.Delivery{Signal: new(adapters.Signal), ID: "a2", Body: []byte("a2"), OrderingKey: "a", Partition: -1, Offset: -1}
	return []*adapters.Delivery{lost, next}, nil
}

func (s *handedOverLost) Ack(context.Context, []*adapters.Delivery) error { return nil }

func (s *handedOverLost) Nack(_ context.Context, ns []adapters.Nack) error {
	ds := deliveriesOf(ns)
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range ds {
		s.nacked = append(s.nacked, d.ID)
	}
	return nil
}

func (s *handedOverLost) Capabilities() adapters.Capabilities {
	return adapters.Capabilities{Name: "handed-over-lost", Ordered: true, NackDelay: true}
}

func (s *handedOverLost) Close() error { return nil }

// TestLaneLossGivesBackTheBatchOfADeliveryLostBeforeItArrived: a source may
// hand over a delivery already lost (an SQS message whose visibility ran out
// while it waited in the source) with the next message of its group. That
// next one was received after the loss but is still behind the lost message,
// which comes back later: it must be given back, not run ahead of it.
func TestLaneLossGivesBackTheBatchOfADeliveryLostBeforeItArrived(t *testing.T) {
	src := &handedOverLost{}
	var mu sync.Mutex
	var ran []string
	r := runOn(t, src, func(_ context.Context, m *consumer.Message) error {
		mu.Lock()
		ran = append(ran, m.ID)
		mu.Unlock()
		return nil
	}, consumer.WithConcurrency(2))
	defer r.stop()
	waitFor(t, "a2 given back", func() bool {
		src.mu.Lock()
		defer src.mu.Unlock()
		return slices.Contains(src.nacked, "a2")
	})
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(ran) != 0 {
		t.Fatalf("ran %v ahead of the lost a1's redelivery; want a2 given back", ran)
	}
}
