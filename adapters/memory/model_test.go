package memory

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// FuzzBrokerAgainstModel drives a queue through publishes, receives from two
// consumers, acks, nacks and extensions, and checks every answer against a
// reference model: a list of messages, each visible or not, with its receive
// count and latest receipt.
//
// Leases and delays are an hour or nothing, so the run never depends on the
// clock: an extension to zero plays the lease running out (the message is
// visible again and its holder keeps a valid receipt until someone receives
// it), a nack for an hour plays a delayed redelivery still pending.
func FuzzBrokerAgainstModel(f *testing.F) {
	f.Add([]byte{0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13})
	f.Add([]byte{1, 0, 0, 0, 0, 0, 4, 5, 12, 6, 14, 7, 18, 1, 9, 2, 11, 3, 4})
	f.Add([]byte{1, 2, 0, 8, 16, 4, 9, 6, 10, 4, 11, 6, 12, 4, 3, 5, 8, 4})
	f.Add([]byte{0, 1, 1, 5, 1, 4, 5, 11, 4, 5, 12, 4, 1, 9, 4, 6, 16, 4, 7})
	f.Add([]byte{1, 1, 2, 0, 1, 0, 1, 4, 5, 9, 17, 4, 13, 15, 4, 10, 14, 4})
	f.Fuzz(func(t *testing.T, prog []byte) {
		if len(prog) < 3 {
			return
		}
		fifo, maxReceives := prog[0]%2 == 1, int(prog[1]%4)
		prog = prog[3:]
		if len(prog) > 300 {
			prog = prog[:300]
		}
		b := NewBroker()
		// The same type as "q": SQS refuses a redrive between types.
		if err := b.CreateQueue("dlq", QueueOptions{FIFO: fifo}); err != nil {
			t.Fatal(err)
		}
		opts := QueueOptions{Lease: time.Hour, FIFO: fifo, MaxReceiveCount: maxReceives}
		if maxReceives > 0 {
			opts.DeadLetterQueue = "dlq"
		}
		if err := b.CreateQueue("q", opts); err != nil {
			t.Fatal(err)
		}
		var srcs [2]*Source
		for i := range srcs {
			s, err := b.Source("q", WithPollWait(time.Nanosecond))
			if err != nil {
				t.Fatal(err)
			}
			srcs[i] = s
		}
		m := &model{fifo: fifo, maxReceives: maxReceives}
		var held []*adapters.Delivery // every delivery ever handed out
		ctx := context.Background()
		next := func() int {
			if len(prog) == 0 {
				return 0
			}
			v := int(prog[0])
			prog = prog[1:]
			return v
		}
		pick := func() (*adapters.Delivery, *modelMsg) {
			if len(held) == 0 {
				return nil, nil
			}
			d := held[next()%len(held)]
			return d, m.byID[d.ID]
		}
		for step := 0; len(prog) > 0; step++ {
			op := next() % 5
			switch op {
			case 0: // publish
				key := "g" + strconv.Itoa(next()%3)
				id := m.publish(key)
				if err := b.Publish(ctx, "q", Message{ID: id, Key: key, Body: []byte(id)}); err != nil {
					t.Fatalf("step %d: Publish: %v", step, err)
				}
			case 1: // receive
				src, max := next()%2, next()%4+1
				want, wantLost := m.receive(max)
				ds, err := srcs[src].Receive(ctx, max)
				if err != nil {
					t.Fatalf("step %d: Receive: %v", step, err)
				}
				if got := ids(ds); !slices.Equal(got, want) {
					t.Fatalf("step %d: Receive(%d) = %v, model says %v", step, max, got, want)
				}
				for _, d := range ds {
					mm := m.byID[d.ID]
					if d.Attempt != mm.receives {
						t.Fatalf("step %d: %s delivered as attempt %d, model says %d", step, d.ID, d.Attempt, mm.receives)
					}
					if fifo && d.OrderingKey != mm.key {
						t.Fatalf("step %d: %s ordering key %q, want %q", step, d.ID, d.OrderingKey, mm.key)
					}
					mm.receipt, mm.holder = d, d
					held = append(held, d)
				}
				for _, d := range wantLost {
					if d.Signal.LostCause() == nil {
						t.Fatalf("step %d: the delivery of %s (attempt %d) is not lost after its message went elsewhere", step, d.ID, d.Attempt)
					}
				}
			case 2: // ack
				d, mm := pick()
				if d == nil {
					continue
				}
				valid := mm.valid(d)
				err := srcs[next()%2].Ack(ctx, []*adapters.Delivery{d})
				checkEntry(t, step, "Ack", d, err, valid)
				if valid {
					m.ack(mm)
				}
			case 3: // nack now or in an hour
				d, mm := pick()
				if d == nil {
					continue
				}
				delay := time.Duration(next()%2) * time.Hour
				valid := mm.valid(d) && !(delay > 0 && m.heldByAnotherReceive(mm))
				err := srcs[next()%2].Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, delay))
				checkEntry(t, step, "Nack", d, err, valid)
				if valid {
					mm.holder, mm.visible = nil, delay == 0
				}
			case 4: // extend by an hour, or to nothing: the lease runs out
				d, mm := pick()
				if d == nil {
					continue
				}
				dur := time.Duration(next()%2) * time.Hour
				valid := mm.valid(d) && !(dur > 0 && m.heldByAnotherReceive(mm))
				err := srcs[next()%2].Extend(ctx, []*adapters.Delivery{d}, dur)
				checkEntry(t, step, "Extend", d, err, valid)
				if valid {
					m.extended++
					mm.visible = dur == 0
				}
			}
			m.check(t, step, b)
		}
	})
}

func checkEntry(t *testing.T, step int, op string, d *adapters.Delivery, err error, valid bool) {
	t.Helper()
	err = adapters.EntryError(err, 0)
	switch {
	case valid && err != nil:
		t.Fatalf("step %d: %s of %s (attempt %d) with its current receipt: %v", step, op, d.ID, d.Attempt, err)
	case !valid && !errors.Is(err, adapters.ErrLeaseLost):
		t.Fatalf("step %d: %s of %s (attempt %d) with a stale receipt = %v, want ErrLeaseLost", step, op, d.ID, d.Attempt, err)
	}
}

type modelMsg struct {
	id       string
	key      string
	visible  bool
	deleted  bool
	receives int
	batch    int                // the receive that delivered it last
	receipt  *adapters.Delivery // the latest delivery, whose receipt is valid
	holder   *adapters.Delivery // the latest delivery, until acked or nacked
}

func (mm *modelMsg) valid(d *adapters.Delivery) bool { return !mm.deleted && mm.receipt == d }

type model struct {
	fifo        bool
	maxReceives int
	msgs        []*modelMsg // in publish order, deleted ones left out
	byID        map[string]*modelMsg
	dead        []string
	received    int64
	acked       int64
	extended    int64
	batches     int // receives so far
}

func (m *model) publish(key string) string {
	if m.byID == nil {
		m.byID = map[string]*modelMsg{}
	}
	id := fmt.Sprintf("p%d", len(m.byID))
	mm := &modelMsg{id: id, key: key, visible: true}
	m.msgs = append(m.msgs, mm)
	m.byID[id] = mm
	return id
}

// busy reports whether a FIFO group has a message received (or delayed) and
// not yet visible again.
func (m *model) busy(key string) bool {
	for _, mm := range m.msgs {
		if mm.key == key && !mm.visible {
			return true
		}
	}
	return false
}

// heldByAnotherReceive reports whether mm, a FIFO message whose lease ran
// out, has a group that a later receive holds: mm cannot be kept (extended or
// delayed) then, or the group would be in flight with two receives.
func (m *model) heldByAnotherReceive(mm *modelMsg) bool {
	if !m.fifo || !mm.visible {
		return false
	}
	for _, o := range m.msgs {
		if o.key == mm.key && !o.visible && o.batch != mm.batch {
			return true
		}
	}
	return false
}

// receive returns the ids a receive of up to max must deliver and the
// deliveries it must take the messages from.
func (m *model) receive(max int) (got []string, lost []*adapters.Delivery) {
	taken := map[string]bool{} // FIFO groups this receive takes from
	m.batches++
	for _, mm := range m.msgs {
		if len(got) >= max {
			break
		}
		if !mm.visible {
			continue
		}
		if m.fifo && !taken[mm.key] {
			if m.busy(mm.key) {
				continue
			}
			taken[mm.key] = true
		}
		mm.receives++
		if mm.holder != nil {
			lost = append(lost, mm.holder)
		}
		if m.maxReceives > 0 && mm.receives > m.maxReceives {
			mm.deleted = true
			m.dead = append(m.dead, mm.id)
			continue
		}
		mm.visible, mm.batch = false, m.batches
		m.received++
		got = append(got, mm.id)
	}
	m.prune()
	return got, lost
}

func (m *model) ack(mm *modelMsg) {
	mm.deleted, mm.holder = true, nil
	m.acked++
	m.prune()
}

func (m *model) prune() {
	m.msgs = slices.DeleteFunc(m.msgs, func(mm *modelMsg) bool { return mm.deleted })
}

func (m *model) check(t *testing.T, step int, b *Broker) {
	t.Helper()
	st, err := b.Stats("q")
	if err != nil {
		t.Fatal(err)
	}
	want := Stats{Received: m.received, Acked: m.acked, Redriven: int64(len(m.dead)), Extended: m.extended}
	for _, mm := range m.msgs {
		if mm.holder != nil && mm.holder.Signal.LostCause() != nil {
			t.Fatalf("step %d: the delivery holding %s is lost: %v", step, mm.id, mm.holder.Signal.LostCause())
		}
		if mm.visible {
			want.Visible++
		} else {
			want.InFlight++
		}
	}
	if st != want {
		t.Fatalf("step %d: Stats = %+v, model says %+v", step, st, want)
	}
	ms, err := b.Messages("q")
	if err != nil {
		t.Fatal(err)
	}
	var got, wantIDs []string
	for _, msg := range ms {
		got = append(got, msg.ID)
		if mm := m.byID[msg.ID]; mm == nil || msg.Receives != mm.receives || msg.Key != mm.key {
			t.Fatalf("step %d: Messages holds %+v, model says %+v", step, msg, mm)
		}
	}
	for _, mm := range m.msgs {
		wantIDs = append(wantIDs, mm.id)
	}
	if !slices.Equal(got, wantIDs) {
		t.Fatalf("step %d: the queue holds %v, model says %v", step, got, wantIDs)
	}
	dead, err := b.Messages("dlq")
	if err != nil {
		t.Fatal(err)
	}
	got = got[:0]
	for _, msg := range dead {
		got = append(got, msg.ID)
		if string(msg.Body) != msg.ID || msg.Headers[adapters.HeaderAttempts] != strconv.Itoa(m.maxReceives) {
			t.Fatalf("step %d: the dead-letter queue holds %+v, want its body and %d attempts", step, msg, m.maxReceives)
		}
	}
	if !slices.Equal(got, m.dead) {
		t.Fatalf("step %d: the dead-letter queue holds %v, model says %v", step, got, m.dead)
	}
}
