package rabbitmq

import (
	"context"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// FuzzAckOrder settles deliveries in an order, with pauses and requeues,
// that the input chooses, on the real broker, with a linger short enough
// that acks go out singly as well as in multiple acks. The broker closes
// the channel on an ack naming a tag it no longer holds (one acked or
// rejected on its own), so the channel staying up is the check that no
// multiple ack names such a tag; and at every step a delivery not yet
// settled by the test must still be held, not covered by a multiple ack.
// At the end, Close flushes the acks, and exactly the requeued messages are
// back in the queue.
//
// The seeds run with go test; go test -fuzz FuzzAckOrder explores more
// (slowly: every input is a round trip to the broker).
func FuzzAckOrder(f *testing.F) {
	f.Add([]byte{8, 0, 1, 2, 3, 4, 5, 6, 7})
	f.Add([]byte{8, 7, 6, 5, 4, 3, 2, 1, 0})
	f.Add([]byte{12, 1, 0x40, 3, 0x41, 2, 0x80, 5, 0, 0x42, 4, 11, 10, 0x43, 9, 8, 7, 6})
	f.Add([]byte{16, 2, 0xc1, 4, 0xc0, 6, 0xc2, 0x81, 8, 0x40, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0})
	f.Add([]byte{5, 0x81, 0x82, 0x83, 0x84, 0x40, 0})
	f.Add([]byte{10, 9, 0x44, 8, 0x44, 7, 0x44, 0x45, 1, 0x44, 2, 0x44, 3})
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) == 0 || len(ops) > 64 {
			t.Skip()
		}
		n := 2 + int(ops[0])%15
		a := newAdmin(t)
		q := a.queue(ClassicQueue, nil)
		a.publish(q, names("m", n)...)
		s := openSource(t, q, WithPrefetch(16), WithAckCoalescing(4, time.Millisecond, 2*time.Millisecond))
		ds := receiveN(t, s, n)
		ctx := context.Background()
		decided := make([]bool, n)
		left := n
		acks, requeues := 0, 0
		// Each byte: the low six bits choose among the deliveries left;
		// the top two say what to do: 0 ack, 1 pause (up to 3 ms, the
		// deliveries waiting beyond an unfinished one go out alone), 2
		// requeue, 3 ack it with the next one left in one call.
		pick := func(b byte) int {
			k := int(b&0x3f) % left
			for i, done := range decided {
				if !done {
					if k == 0 {
						return i
					}
					k--
				}
			}
			panic("no delivery left")
		}
		for _, b := range ops[1:] {
			if left == 0 {
				break
			}
			switch b >> 6 {
			case 1:
				time.Sleep(time.Duration(b&3) * time.Millisecond)
				continue
			case 2:
				i := pick(b)
				if err := s.Nack(ctx, adapters.NackAll(ds[i:i+1], 0)); err != nil {
					t.Fatal(err)
				}
				decided[i], left, requeues = true, left-1, requeues+1
			default:
				i := pick(b)
				batch := []*adapters.Delivery{ds[i]}
				decided[i], left, acks = true, left-1, acks+1
				if b>>6 == 3 && left > 0 {
					j := pick(0)
					batch = append(batch, ds[j])
					decided[j], left, acks = true, left-1, acks+1
				}
				if err := s.Ack(ctx, batch); err != nil {
					t.Fatal(err)
				}
			}
			for i, d := range ds {
				h := handleOf(d)
				h.gen.mu.Lock()
				st := h.state
				h.gen.mu.Unlock()
				if !decided[i] && st != stateHeld {
					t.Fatalf("delivery %d, not settled by the test, is in state %d", i, st)
				}
			}
		}
		var rest []*adapters.Delivery
		for i, done := range decided {
			if !done {
				rest = append(rest, ds[i])
				acks++
			}
		}
		if err := s.Ack(ctx, rest); err != nil {
			t.Fatal(err)
		}
		time.Sleep(3 * time.Millisecond) // let some go out on their own
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		if st := s.Stats(); st.Generations != 1 || st.Acked != uint64(acks) || st.AckErrors != 0 {
			t.Fatalf("stats %+v: want %d acked on one channel", st, acks)
		}
		a.waitReady(q, requeues)
	})
}
