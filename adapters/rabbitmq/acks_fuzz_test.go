package rabbitmq

import (
	"context"
	"testing"

	"github.com/custody-go/custody/adapters"
)

// FuzzAckOrder settles deliveries in an order, in batches and with requeues
// that the input chooses, on the real broker, and checks each Ack call
// against the rule: the call writes, before it returns, one multiple=true
// ack for the run of finished tags from the oldest outstanding one (when
// that run holds more than one tag still outstanding on the wire; one tag
// goes alone), and one ack each for its deliveries left behind a tag not
// finished; nothing else. A model of the finished prefix gives the frames
// each call must write. The broker closes the channel on an ack naming a
// tag it no longer holds, so a round trip on the channel at the end checks
// that no multiple ack named one; a delivery the test has not settled must
// still be held at every step, not covered by a multiple ack; and after
// Close exactly the requeued messages are back in the queue, so every ack
// reached the broker.
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
	f.Add([]byte{14, 0xc3, 0x45, 0x81, 0xc0, 0x47, 0x02})
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) == 0 || len(ops) > 64 {
			t.Skip()
		}
		n := 2 + int(ops[0])%15
		a := newAdmin(t)
		q := a.queue(ClassicQueue, nil)
		a.publish(q, names("m", n)...)
		s := openSource(t, q, WithPrefetch(16))
		ds := receiveN(t, s, n)
		for i, d := range ds {
			if tag := handleOf(d).tag; tag != uint64(i+1) {
				t.Fatalf("delivery %d has tag %d", i, tag)
			}
		}
		ctx := context.Background()
		decided := make([]bool, n)
		front := 0 // the model's frontier: deliveries [0, front) are all decided
		left := n
		requeues := 0
		// Each byte: the low six bits choose among the deliveries left;
		// the top two say what to do: 0 ack it; 1 ack it and up to two
		// more of those left after it, in one call, the latest first; 2
		// requeue it; 3 ack it with the next one left in one call, naming
		// it twice.
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
		next := func(after int) int {
			for i := after + 1; i < n; i++ {
				if !decided[i] {
					return i
				}
			}
			return -1
		}
		ack := func(idx []int) {
			t.Helper()
			before := s.Stats()
			var batch []*adapters.Delivery
			unique := map[int]bool{}
			for _, i := range idx {
				batch = append(batch, ds[i])
				if !unique[i] {
					unique[i] = true
					decided[i], left = true, left-1
				}
			}
			if err := s.Ack(ctx, batch); err != nil {
				t.Fatal(err)
			}
			for front < n && decided[front] {
				front++
			}
			inRun, beyond := 0, 0
			for i := range unique {
				if i < front {
					inRun++
				} else {
					beyond++
				}
			}
			wantFrames, wantMultiple := uint64(beyond), uint64(0)
			if inRun > 0 {
				wantFrames++
			}
			if inRun > 1 {
				wantMultiple = 1
			}
			after := s.Stats()
			if frames, multiple, acked := after.AckFrames-before.AckFrames, after.MultipleAcks-before.MultipleAcks, after.Acked-before.Acked; frames != wantFrames || multiple != wantMultiple || acked != uint64(len(unique)) {
				t.Fatalf("Ack of %v (frontier now %d) wrote %d frames (%d multiple) acking %d; want %d (%d multiple) acking %d", idx, front, frames, multiple, acked, wantFrames, wantMultiple, len(unique))
			}
		}
		for _, b := range ops[1:] {
			if left == 0 {
				break
			}
			i := pick(b)
			switch b >> 6 {
			case 0:
				ack([]int{i})
			case 1:
				idx := []int{i}
				for j := next(i); j >= 0 && len(idx) < 3; j = next(j) {
					idx = append(idx, j)
				}
				for l, r := 0, len(idx)-1; l < r; l, r = l+1, r-1 {
					idx[l], idx[r] = idx[r], idx[l]
				}
				ack(idx)
			case 2:
				if err := s.Nack(ctx, adapters.NackAll(ds[i:i+1], 0)); err != nil {
					t.Fatal(err)
				}
				decided[i], left, requeues = true, left-1, requeues+1
				for front < n && decided[front] {
					front++
				}
			case 3:
				idx := []int{i, i}
				if j := next(i); j >= 0 {
					idx = append(idx, j)
				}
				ack(idx)
			}
			for i, d := range ds {
				h := handleOf(d)
				h.gen.mu.Lock()
				st := h.state
				h.gen.mu.Unlock()
				if want := map[bool]state{false: stateHeld, true: stateSettled}[decided[i]]; st != want {
					t.Fatalf("delivery %d (decided %t) is in state %d, want %d", i, decided[i], st, want)
				}
			}
		}
		var rest []int
		for i, done := range decided {
			if !done {
				rest = append(rest, i)
			}
		}
		if len(rest) > 0 {
			ack(rest)
		}
		// A round trip on the consuming channel: the broker closed it if an
		// ack named a tag it no longer held.
		if _, err := handleOf(ds[0]).gen.ch.QueueDeclarePassive(q, true, false, false, false, nil); err != nil {
			t.Fatalf("the consuming channel is gone: %v", err)
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		if st := s.Stats(); st.Generations != 1 || st.Acked != uint64(n-requeues) || st.AckErrors != 0 {
			t.Fatalf("stats %+v: want %d acked on one channel", st, n-requeues)
		}
		a.waitReady(q, requeues)
	})
}
