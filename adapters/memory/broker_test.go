package memory

import (
	"context"
	"errors"
	"maps"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// patience bounds waits for something that must happen. The tests below use
// leases and poll waits of an hour, so a wait that only ends at the lease or
// the poll deadline shows as a failure after patience, never as slowness.
const patience = 30 * time.Second

func newTestBroker(t *testing.T, opts QueueOptions) *Broker {
	t.Helper()
	b := NewBroker()
	if err := b.CreateQueue("q", opts); err != nil {
		t.Fatal(err)
	}
	return b
}

func openSource(t *testing.T, b *Broker, opts ...SourceOption) *Source {
	t.Helper()
	s, err := b.Source("q", opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func receive(t *testing.T, s *Source, max int) []*adapters.Delivery {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	ds, err := s.Receive(ctx, max)
	if err != nil {
		t.Fatalf("Receive: %v", err)
	}
	return ds
}

func ids(ds []*adapters.Delivery) []string {
	out := make([]string, len(ds))
	for i, d := range ds {
		out[i] = d.ID
	}
	return out
}

// receiveInBackground starts a Receive on s and waits until it blocks in the
// broker for something to become visible.
func receiveInBackground(t *testing.T, b *Broker, s *Source) <-chan []*adapters.Delivery {
	t.Helper()
	got := make(chan []*adapters.Delivery, 1)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	t.Cleanup(cancel)
	go func() {
		ds, err := s.Receive(ctx, 10)
		if err != nil {
			t.Errorf("background Receive: %v", err)
		}
		got <- ds
	}()
	waitUntilReceiveWaits(t, b, s)
	return got
}

// Messages must not disturb the queue: it once sorted the broker's own
// messages through a heap, which rewrote their heap positions, so a later ack
// removed another message from the queue (lost for good) and left the acked
// one in place (delivered again).
func TestMessagesKeepsQueueIntact(t *testing.T) {
	b := newTestBroker(t, QueueOptions{Lease: time.Hour})
	if err := b.Publish(context.Background(), "q", Message{ID: "a"}, Message{ID: "b"}, Message{ID: "c"}); err != nil {
		t.Fatal(err)
	}
	src := openSource(t, b)
	ds := receive(t, src, 3)
	if len(ds) != 3 {
		t.Fatalf("received %v, want a, b and c", ids(ds))
	}
	if _, err := b.Messages("q"); err != nil {
		t.Fatal(err)
	}
	if err := src.Ack(context.Background(), ds[:1]); err != nil {
		t.Fatalf("Ack: %v", err)
	}
	ms, err := b.Messages("q")
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	for _, m := range ms {
		left = append(left, m.ID)
	}
	if !slices.Equal(left, []string{"b", "c"}) {
		t.Fatalf("after acking a the queue holds %v, want [b c]", left)
	}
	if err := src.Nack(context.Background(), adapters.NackAll(ds[1:], 0)); err != nil {
		t.Fatalf("Nack: %v", err)
	}
	if again := ids(receive(t, src, 3)); !slices.Equal(again, []string{"b", "c"}) {
		t.Fatalf("after nacking b and c the queue delivers %v, want [b c]", again)
	}
}

// A fault hook is user code: it may look at the broker (Stats, Messages,
// Publish) without deadlocking the call it is asked about.
func TestFaultHookMayUseBroker(t *testing.T) {
	b := newTestBroker(t, QueueOptions{Lease: time.Hour})
	if err := b.Publish(context.Background(), "q", Message{ID: "a"}); err != nil {
		t.Fatal(err)
	}
	errAckFault := errors.New("injected")
	src := openSource(t, b, WithFaults(Faults{Ack: func(d *adapters.Delivery) error {
		if _, err := b.Stats("q"); err != nil {
			return err
		}
		return errAckFault
	}}))
	ds := receive(t, src, 1)
	done := make(chan error, 1)
	go func() { done <- src.Ack(context.Background(), ds) }()
	select {
	case err := <-done:
		if !errors.Is(adapters.EntryError(err, 0), errAckFault) {
			t.Fatalf("Ack = %v, want the injected fault", err)
		}
	case <-time.After(patience):
		t.Fatal("Ack deadlocked: the fault hook ran under the broker's lock")
	}
}

// Acking the message that holds a FIFO group back must wake a receiver
// waiting on the queue, as SQS answers a long poll once the group is free.
func TestFIFOAckWakesWaitingReceiver(t *testing.T) {
	b := newTestBroker(t, QueueOptions{Lease: time.Hour, FIFO: true})
	if err := b.Publish(context.Background(), "q", Message{ID: "a", Key: "g"}, Message{ID: "b", Key: "g"}); err != nil {
		t.Fatal(err)
	}
	first := openSource(t, b)
	ds := receive(t, first, 1)
	if got := ids(ds); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("received %v, want [a]", got)
	}
	got := receiveInBackground(t, b, openSource(t, b, WithPollWait(time.Hour)))
	if err := first.Ack(context.Background(), ds); err != nil {
		t.Fatalf("Ack: %v", err)
	}
	if ds := <-got; !slices.Equal(ids(ds), []string{"b"}) {
		t.Fatalf("waiting receiver got %v once the group was free, want [b]", ids(ds))
	}
}

// A nack's delay, not the lease it replaces, decides when a waiting receiver
// gets the message again.
func TestNackDelayWakesWaitingReceiver(t *testing.T) {
	b := newTestBroker(t, QueueOptions{Lease: time.Hour})
	if err := b.Publish(context.Background(), "q", Message{ID: "a"}); err != nil {
		t.Fatal(err)
	}
	first := openSource(t, b)
	ds := receive(t, first, 1)
	got := receiveInBackground(t, b, openSource(t, b, WithPollWait(time.Hour)))
	if err := first.Nack(context.Background(), adapters.NackAll(ds, 10*time.Millisecond)); err != nil {
		t.Fatalf("Nack: %v", err)
	}
	if ds := <-got; !slices.Equal(ids(ds), []string{"a"}) {
		t.Fatalf("waiting receiver got %v after the nack delay, want [a]", ids(ds))
	}
}

// A delivery whose lease ran out is lost as soon as another consumer
// receives the message: its signal closes, and it can no longer ack, nack or
// extend what is now someone else's receive.
func TestStolenLeaseLosesDelivery(t *testing.T) {
	b := newTestBroker(t, QueueOptions{Lease: 20 * time.Millisecond})
	if err := b.Publish(context.Background(), "q", Message{ID: "a"}); err != nil {
		t.Fatal(err)
	}
	first, second := openSource(t, b), openSource(t, b, WithPollWait(time.Hour))
	old := receive(t, first, 1)
	fresh := receive(t, second, 1) // once the 20ms lease has run out
	if len(old) != 1 || len(fresh) != 1 || fresh[0].Attempt != 2 {
		t.Fatalf("received %v then %v, want a twice, the second time as attempt 2", ids(old), ids(fresh))
	}
	select {
	case <-old[0].Signal.Lost():
	default:
		t.Fatal("the first delivery is not lost after the message went to another consumer")
	}
	if !errors.Is(old[0].Signal.LostCause(), adapters.ErrLeaseLost) {
		t.Errorf("lost cause %v, want one wrapping ErrLeaseLost", old[0].Signal.LostCause())
	}
	ctx := context.Background()
	if err := first.Extend(ctx, old, time.Hour); !errors.Is(adapters.EntryError(err, 0), adapters.ErrLeaseLost) {
		t.Errorf("Extend of the stale delivery: %v, want ErrLeaseLost", err)
	}
	if err := first.Nack(ctx, adapters.NackAll(old, 0)); !errors.Is(adapters.EntryError(err, 0), adapters.ErrLeaseLost) {
		t.Errorf("Nack of the stale delivery: %v, want ErrLeaseLost", err)
	}
	if err := first.Ack(ctx, old); !errors.Is(adapters.EntryError(err, 0), adapters.ErrLeaseLost) {
		t.Errorf("Ack of the stale delivery: %v, want ErrLeaseLost", err)
	}
	if err := second.Ack(ctx, fresh); err != nil {
		t.Fatalf("Ack of the fresh delivery: %v", err)
	}
	if st, _ := b.Stats("q"); st.Acked != 1 || st.Visible != 0 || st.InFlight != 0 {
		t.Errorf("stats %+v, want one ack and nothing left", st)
	}
}

// MaxReceiveCount moves a message to the dead-letter queue instead of its
// (MaxReceiveCount+1)th delivery, saying how often it was received, and the
// last holder loses it.
func TestRedriveAfterMaxReceiveCount(t *testing.T) {
	b := NewBroker()
	if err := b.CreateQueue("dlq", QueueOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := b.CreateQueue("q", QueueOptions{Lease: time.Hour, MaxReceiveCount: 2, DeadLetterQueue: "dlq"}); err != nil {
		t.Fatal(err)
	}
	if err := b.Publish(context.Background(), "q", Message{ID: "a", Headers: map[string]string{"h": "v"}}); err != nil {
		t.Fatal(err)
	}
	src := openSource(t, b, WithPollWait(10*time.Millisecond))
	var last *adapters.Delivery
	for want := 1; want <= 2; want++ {
		ds := receive(t, src, 1)
		if len(ds) != 1 || ds[0].Attempt != want {
			t.Fatalf("receive %d: %v, want a as attempt %d", want, ids(ds), want)
		}
		if err := src.Nack(context.Background(), adapters.NackAll(ds, 0)); err != nil {
			t.Fatal(err)
		}
		last = ds[0]
	}
	if ds := receive(t, src, 1); len(ds) != 0 {
		t.Fatalf("third receive got %v, want nothing: the message is redriven", ids(ds))
	}
	dead, err := b.Messages("dlq")
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 1 || dead[0].ID != "a" || dead[0].Headers[adapters.HeaderAttempts] != "2" ||
		dead[0].Headers[adapters.HeaderOriginalQueue] != "q" || dead[0].Headers["h"] != "v" {
		t.Fatalf("dead-letter queue holds %+v, want a with 2 attempts from q and its header", dead)
	}
	if st, _ := b.Stats("q"); st.Redriven != 1 || st.Visible != 0 || st.InFlight != 0 {
		t.Errorf("stats %+v, want one redriven and nothing left", st)
	}
	if err := src.Ack(context.Background(), []*adapters.Delivery{last}); !errors.Is(adapters.EntryError(err, 0), adapters.ErrLeaseLost) {
		t.Errorf("Ack after the redrive: %v, want ErrLeaseLost", err)
	}
}

// TestPublishKeepsItsOwnCopy: a caller reusing its buffer or headers map
// after Publish does not change the queued message.
func TestPublishKeepsItsOwnCopy(t *testing.T) {
	b := newTestBroker(t, QueueOptions{})
	body, headers := []byte("original"), map[string]string{"h": "original"}
	if err := b.Publish(context.Background(), "q", Message{Body: body, Headers: headers}); err != nil {
		t.Fatal(err)
	}
	copy(body, "reused!!")
	headers["h"] = "reused"
	ds := receive(t, openSource(t, b), 1)
	if len(ds) != 1 || string(ds[0].Body) != "original" || ds[0].Headers["h"] != "original" {
		t.Fatalf("received %q %v; want the message as published", ds[0].Body, ds[0].Headers)
	}
}

// TestClosedSourceSaysSoBeforeItsFaults: a closed or crashed source's
// Receive returns ErrClosed, which ends a consumer's Run, even with a
// receive fault installed, whose error the runtime would retry for ever.
func TestClosedSourceSaysSoBeforeItsFaults(t *testing.T) {
	b := newTestBroker(t, QueueOptions{})
	s := openSource(t, b, WithFaults(Faults{Receive: func() error { return errors.New("injected") }}))
	s.Crash()
	if _, err := s.Receive(context.Background(), 1); !errors.Is(err, adapters.ErrClosed) {
		t.Fatalf("Receive on a crashed source = %v, want ErrClosed", err)
	}
}

// Close and Crash end a Receive that is waiting for a message: with a long
// poll it would otherwise hold its goroutine, and whoever waits for it, until
// the poll ran out, long after the source was gone.
func TestCloseEndsWaitingReceive(t *testing.T) {
	for name, stop := range map[string]func(*Source){
		"Close": func(s *Source) { _ = s.Close() },
		"Crash": (*Source).Crash,
	} {
		t.Run(name, func(t *testing.T) {
			b := newTestBroker(t, QueueOptions{Lease: time.Hour})
			s := openSource(t, b, WithPollWait(time.Hour))
			done := make(chan error, 1)
			go func() {
				_, err := s.Receive(context.Background(), 1)
				done <- err
			}()
			waitUntilReceiveWaits(t, b, s)
			stop(s)
			select {
			case err := <-done:
				if !errors.Is(err, adapters.ErrClosed) {
					t.Fatalf("waiting Receive returned %v, want ErrClosed", err)
				}
			case <-time.After(patience):
				t.Fatalf("a Receive waiting when %s was called still waits", name)
			}
		})
	}
}

// waitUntilReceiveWaits returns once a Receive on s blocks in the broker for
// something to become visible.
func waitUntilReceiveWaits(t *testing.T, b *Broker, s *Source) {
	t.Helper()
	deadline := time.Now().Add(patience)
	for {
		b.mu.Lock()
		waiting := s.q.wake != nil
		b.mu.Unlock()
		if waiting {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the background Receive never waited")
		}
		time.Sleep(time.Millisecond)
	}
}

// A FIFO queue refuses a message without a group: the runtime keeps order
// only by a non-empty key, so keyless messages received together were
// handled side by side, out of order. Nothing of the batch is published.
func TestFIFOPublishNeedsKey(t *testing.T) {
	b := newTestBroker(t, QueueOptions{Lease: time.Hour, FIFO: true})
	err := b.Publish(context.Background(), "q", Message{ID: "a", Key: "g"}, Message{ID: "b"})
	if err == nil || !strings.Contains(err.Error(), "Message.Key") {
		t.Fatalf("Publish of a keyless message to a FIFO queue = %v, want an error naming Message.Key", err)
	}
	if st, _ := b.Stats("q"); st.Visible != 0 {
		t.Fatalf("the refused batch left %d messages in the queue, want none", st.Visible)
	}
}

// A dead-letter queue without a MaxReceiveCount would never receive
// anything: CreateQueue says so instead of letting poison messages come back
// for ever.
func TestCreateQueueRefusesDeadLetterQueueWithoutCount(t *testing.T) {
	b := NewBroker()
	if err := b.CreateQueue("dlq", QueueOptions{}); err != nil {
		t.Fatal(err)
	}
	err := b.CreateQueue("q", QueueOptions{DeadLetterQueue: "dlq"})
	if err == nil || !strings.Contains(err.Error(), "MaxReceiveCount") {
		t.Fatalf("CreateQueue with a DeadLetterQueue and no MaxReceiveCount = %v, want an error naming MaxReceiveCount", err)
	}
}

// SQS refuses a redrive policy between a FIFO queue and a standard one, either
// way round; so does the memory broker, so that a queue pair tested here can
// be created there.
func TestCreateQueueRefusesRedriveBetweenTypes(t *testing.T) {
	for _, fifo := range []bool{false, true} {
		b := NewBroker()
		if err := b.CreateQueue("dlq", QueueOptions{FIFO: !fifo}); err != nil {
			t.Fatal(err)
		}
		err := b.CreateQueue("q", QueueOptions{FIFO: fifo, MaxReceiveCount: 1, DeadLetterQueue: "dlq"})
		if err == nil || !strings.Contains(err.Error(), "DeadLetterQueue") || !strings.Contains(err.Error(), "same type") {
			t.Fatalf("CreateQueue(FIFO %t) redriving into a queue of the other type = %v, want an error naming DeadLetterQueue and the types", fifo, err)
		}
		if err := b.CreateQueue("same", QueueOptions{FIFO: !fifo, MaxReceiveCount: 1, DeadLetterQueue: "dlq"}); err != nil {
			t.Fatalf("CreateQueue(FIFO %t) redriving into a queue of its own type: %v", !fifo, err)
		}
	}
}

// A message dead-lettered before and replayed carries that trip's
// diagnostics. When the queue redrives it, the dead-letter copy describes
// this redrive alone: an old error, or the partition of the old copy beside
// the new copy's queue, would send whoever reads it after the wrong failure.
func TestRedriveReplacesEarlierDiagnostics(t *testing.T) {
	b := NewBroker()
	if err := b.CreateQueue("dlq", QueueOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := b.CreateQueue("q", QueueOptions{Lease: time.Hour, MaxReceiveCount: 1, DeadLetterQueue: "dlq"}); err != nil {
		t.Fatal(err)
	}
	replayed := map[string]string{
		"h":                               "v",
		adapters.HeaderError:              "an earlier trip's error",
		adapters.HeaderPermanent:          "true",
		adapters.HeaderAttempts:           "7",
		adapters.HeaderOriginalQueue:      "orders-topic",
		adapters.HeaderOriginalPart:       "3",
		adapters.HeaderOriginalOffset:     "42",
		adapters.HeaderConsumer:           "an earlier consumer",
		adapters.HeaderFirstFailure:       "2020-01-01T00:00:00Z",
		adapters.HeaderOriginalRoutingKey: "rk",
	}
	if err := b.Publish(context.Background(), "q", Message{ID: "a", Body: []byte("body"), Headers: replayed}); err != nil {
		t.Fatal(err)
	}
	src := openSource(t, b, WithPollWait(10*time.Millisecond))
	if err := src.Nack(context.Background(), adapters.NackAll(receive(t, src, 1), 0)); err != nil {
		t.Fatal(err)
	}
	if ds := receive(t, src, 1); len(ds) != 0 {
		t.Fatalf("second receive got %v, want nothing: the message is redriven", ids(ds))
	}
	dead, err := b.Messages("dlq")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"h": "v", adapters.HeaderOriginalQueue: "q", adapters.HeaderAttempts: "1"}
	if len(dead) != 1 || string(dead[0].Body) != "body" || !maps.Equal(dead[0].Headers, want) {
		t.Fatalf("dead-letter queue holds %+v, want body %q with headers %v", dead, "body", want)
	}
}

// Send stores its own copy of the body, as Publish does: a caller reusing
// its buffer once the write is confirmed must not rewrite the dead letter.
func TestDeadLetterKeepsItsOwnCopy(t *testing.T) {
	b := newTestBroker(t, QueueOptions{})
	dlq, err := b.DeadLetterQueue("q")
	if err != nil {
		t.Fatal(err)
	}
	body := []byte("original")
	d := &adapters.Delivery{ID: "a", Body: body, Partition: -1, Offset: -1}
	if err := dlq.Send(context.Background(), d, adapters.Failure{Err: errors.New("boom"), Attempts: 1}); err != nil {
		t.Fatal(err)
	}
	copy(body, "reused!!")
	dead, err := b.Messages("q")
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 1 || string(dead[0].Body) != "original" {
		t.Fatalf("dead-letter queue holds %+v, want the body as sent", dead)
	}
}

// Generated IDs are unique across brokers, not only within one: a new broker
// (a restarted process) must not hand out the IDs an earlier one did, which
// a store outliving it may still hold.
func TestGeneratedIDsDifferAcrossBrokers(t *testing.T) {
	seen := map[string]bool{}
	for range 2 {
		b := newTestBroker(t, QueueOptions{Lease: time.Hour})
		if err := b.Publish(context.Background(), "q", Message{}, Message{}, Message{ID: "mine"}); err != nil {
			t.Fatal(err)
		}
		ms, err := b.Messages("q")
		if err != nil {
			t.Fatal(err)
		}
		if ms[2].ID != "mine" {
			t.Errorf("a message published with ID %q reads back as %q", "mine", ms[2].ID)
		}
		for _, m := range ms[:2] {
			if m.ID == "" || seen[m.ID] {
				t.Errorf("generated ID %q is empty or was generated before", m.ID)
			}
			seen[m.ID] = true
		}
	}
}

// A FIFO dead-letter queue takes keyless copies (DeadLetterQueue.Send of a
// delivery from a standard queue or another broker); each gets a group of its own, so one copy in
// flight does not hold up the others.
func TestKeylessDeadLettersOnFIFOQueueDoNotBlockEachOther(t *testing.T) {
	b := NewBroker()
	if err := b.CreateQueue("dlq", QueueOptions{Lease: time.Hour, FIFO: true}); err != nil {
		t.Fatal(err)
	}
	dlq, err := b.DeadLetterQueue("dlq")
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"a", "b"} {
		d := &adapters.Delivery{ID: id, Body: []byte(id), Queue: "elsewhere", Partition: -1, Offset: -1}
		if err := dlq.Send(context.Background(), d, adapters.Failure{Err: errors.New("poison"), Attempts: 1}); err != nil {
			t.Fatal(err)
		}
	}
	src, err := b.Source("dlq", WithPollWait(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = src.Close() })
	var got []string
	for range 2 { // one at a time: the first stays in flight
		ds, err := src.Receive(context.Background(), 1)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range ds {
			got = append(got, d.ID)
		}
	}
	if !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("received %v with the first copy in flight, want [a b]: keyless copies share a FIFO group", got)
	}
}

// newRedriveBroker returns a broker whose queue "q" holds one message, "a",
// and moves it to "dlq" instead of delivering it a second time. Leases are
// an hour: the tests play their expiry.
func newRedriveBroker(t *testing.T) *Broker {
	t.Helper()
	b := NewBroker()
	if err := b.CreateQueue("dlq", QueueOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := b.CreateQueue("q", QueueOptions{Lease: time.Hour, MaxReceiveCount: 1, DeadLetterQueue: "dlq"}); err != nil {
		t.Fatal(err)
	}
	if err := b.Publish(context.Background(), "q", Message{ID: "a"}); err != nil {
		t.Fatal(err)
	}
	return b
}

// A redriven message keeps its publish time, as an SQS redrive keeps the
// enqueue timestamp: the dead-letter queue holds the same message, not a new
// one published at the move.
func TestRedriveKeepsThePublishTime(t *testing.T) {
	b := newRedriveBroker(t)
	src := openSource(t, b, WithPollWait(10*time.Millisecond))
	first := receive(t, src, 1)
	if len(first) != 1 {
		t.Fatalf("first receive: %v", ids(first))
	}
	if err := src.Nack(context.Background(), adapters.NackAll(first, 0)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond) // the move happens visibly later than the publish
	if ds := receive(t, src, 1); len(ds) != 0 {
		t.Fatalf("second receive got %v, want nothing: the message is redriven", ids(ds))
	}
	dsrc, err := b.Source("dlq", WithPollWait(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dsrc.Close() })
	dead := receive(t, dsrc, 1)
	if len(dead) != 1 {
		t.Fatalf("dead-letter queue: %v, want a", ids(dead))
	}
	if !dead[0].PublishedAt.Equal(first[0].PublishedAt) {
		t.Errorf("redriven copy published at %v, want the original's %v", dead[0].PublishedAt, first[0].PublishedAt)
	}
}

// Every call that cannot work fails at once with an error that names what
// is wrong: an option, a missing queue (ErrNoQueue), or a delivery of
// another queue.
func TestInvalidCallsFailNamingTheProblem(t *testing.T) {
	ctx := context.Background()
	b := NewBroker()
	for _, q := range []string{"q", "other", "dlq"} {
		if err := b.CreateQueue(q, QueueOptions{Lease: time.Hour}); err != nil {
			t.Fatal(err)
		}
	}
	names := map[string]error{
		"empty queue name":      b.CreateQueue("", QueueOptions{}),
		"Lease":                 b.CreateQueue("x1", QueueOptions{Lease: -time.Second}),
		"MaxReceiveCount":       b.CreateQueue("x2", QueueOptions{MaxReceiveCount: -1}),
		"must name an existing": b.CreateQueue("x3", QueueOptions{MaxReceiveCount: 3, DeadLetterQueue: "nowhere"}),
		"queue exists":          b.CreateQueue("q", QueueOptions{}),
		"WithPollWait":          func() error { _, err := b.Source("q", WithPollWait(0)); return err }(),
		"Receive: max 0":        func() error { _, err := openSource(t, b).Receive(ctx, 0); return err }(),
		"did not come from":     nil, // below
		"Publish(\"nowhere\")":  b.Publish(ctx, "nowhere", Message{Body: []byte("x")}),
		"Stats(\"nowhere\")":    func() error { _, err := b.Stats("nowhere"); return err }(),
		"Messages(\"nowhere\")": func() error { _, err := b.Messages("nowhere"); return err }(),
		"Source(\"nowhere\")":   func() error { _, err := b.Source("nowhere"); return err }(),
		"DeadLetterQueue(\"now": func() error { _, err := b.DeadLetterQueue("nowhere"); return err }(),
	}
	// An ack for another queue's delivery fails that entry, and acks nothing.
	if err := b.Publish(ctx, "other", Message{ID: "o"}); err != nil {
		t.Fatal(err)
	}
	other, err := b.Source("other")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	ds := receive(t, other, 1)
	err = openSource(t, b).Ack(ctx, ds)
	names["did not come from"] = adapters.EntryError(err, 0)
	if st, _ := b.Stats("other"); st.Acked != 0 {
		t.Errorf("an ack through another queue's source acked %d messages", st.Acked)
	}
	for want, err := range names {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("got %v, want an error saying %q", err, want)
		}
	}
	for _, call := range []string{"Publish", "Stats", "Messages", "Source", "DeadLetterQueue"} {
		for want, err := range names {
			if strings.HasPrefix(want, call+"(") && !errors.Is(err, ErrNoQueue) {
				t.Errorf("%s of a missing queue = %v, want ErrNoQueue", call, err)
			}
		}
	}
}

// A message redriven while its last holder's lease has run out, unacked
// (a handler still running whose extension failed), is lost to that holder
// at once, as when another consumer receives it: the holder's context is
// cancelled rather than left running on a message now in the dead-letter
// queue, whose ack can only fail.
func TestRedriveLosesTheLastHoldersDelivery(t *testing.T) {
	b := newRedriveBroker(t)
	holder, other := openSource(t, b), openSource(t, b, WithPollWait(10*time.Millisecond))
	held := receive(t, holder, 1)
	if len(held) != 1 {
		t.Fatalf("received %v, want a", ids(held))
	}
	// The lease runs out: an extension to zero, so no clock is involved.
	if err := holder.Extend(context.Background(), held, 0); err != nil {
		t.Fatal(err)
	}
	select {
	case <-held[0].Signal.Lost():
		t.Fatal("the delivery is lost before anyone else took the message")
	default:
	}
	if ds := receive(t, other, 1); len(ds) != 0 {
		t.Fatalf("second receive got %v, want nothing: the message is redriven", ids(ds))
	}
	if dead, err := b.Messages("dlq"); err != nil || len(dead) != 1 {
		t.Fatalf("dead-letter queue holds %v (%v), want a", dead, err)
	}
	select {
	case <-held[0].Signal.Lost():
	default:
		t.Fatal("the last holder's delivery is not lost after its message was redriven")
	}
	if !errors.Is(held[0].Signal.LostCause(), adapters.ErrLeaseLost) {
		t.Errorf("lost cause %v, want one wrapping ErrLeaseLost", held[0].Signal.LostCause())
	}
}

// A FIFO message whose lease ran out, extended by its holder before anyone
// else received it, is held again, and so is its group: the next message of
// the group waits until it is acked, as SQS keeps a group blocked while one
// of its messages is in flight.
func TestFIFOMessageExtendedAfterItsLeaseRanOutHoldsItsGroupAgain(t *testing.T) {
	b := newTestBroker(t, QueueOptions{Lease: time.Hour, FIFO: true})
	if err := b.Publish(context.Background(), "q", Message{ID: "a1", Key: "g"}, Message{ID: "a2", Key: "g"}); err != nil {
		t.Fatal(err)
	}
	holder, other := openSource(t, b), openSource(t, b, WithPollWait(10*time.Millisecond))
	ctx := context.Background()
	held := receive(t, holder, 1)
	if len(held) != 1 || held[0].ID != "a1" {
		t.Fatalf("received %v, want a1", ids(held))
	}
	// The lease runs out (an extension to zero, so no clock is involved),
	// then the holder extends it before anyone took the message.
	if err := holder.Extend(ctx, held, 0); err != nil {
		t.Fatal(err)
	}
	if err := holder.Extend(ctx, held, time.Hour); err != nil {
		t.Fatalf("extending the held message after its lease ran out: %v", err)
	}
	if ds := receive(t, other, 10); len(ds) != 0 {
		t.Fatalf("received %v while a1 is held, want nothing: its group is blocked", ids(ds))
	}
	if err := holder.Ack(ctx, held); err != nil {
		t.Fatal(err)
	}
	if ds := receive(t, other, 10); len(ds) != 1 || ds[0].ID != "a2" {
		t.Fatalf("received %v after a1 was acked, want a2", ids(ds))
	}
}

// A FIFO message acked after its lease ran out (nobody received it since, so
// its receipt is still valid) was no longer holding its group: the ack must
// not release the group a second time while another of its messages is in
// flight, or the next message would be delivered before that one is done.
func TestFIFOAckAfterTheLeaseRanOutKeepsTheGroupBlocked(t *testing.T) {
	b, holder, other, held := receiveGroupOfTwo(t)
	ctx := context.Background()
	// a1's lease runs out (an extension to zero, so no clock is involved);
	// a2 stays in flight.
	if err := holder.Extend(ctx, held[:1], 0); err != nil {
		t.Fatal(err)
	}
	if err := holder.Ack(ctx, held[:1]); err != nil {
		t.Fatalf("ack of a1 after its lease ran out, before anyone took it: %v", err)
	}
	if err := b.Publish(ctx, "q", Message{ID: "a3", Key: "g"}); err != nil {
		t.Fatal(err)
	}
	if ds := receive(t, other, 10); len(ds) != 0 {
		t.Fatalf("received %v while a2 is in flight, want nothing: its group is blocked", ids(ds))
	}
	if err := holder.Ack(ctx, held[1:]); err != nil {
		t.Fatal(err)
	}
	if ds := receive(t, other, 10); len(ds) != 1 || ds[0].ID != "a3" {
		t.Fatalf("received %v after a2 was acked, want a3", ids(ds))
	}
}

// A receive fault fails that Receive with the hook's error and takes no
// message: the message stays visible, never counted as received, for the
// next Receive once the fault is gone.
func TestReceiveFaultTakesNoMessage(t *testing.T) {
	b := newTestBroker(t, QueueOptions{Lease: time.Hour})
	ctx := context.Background()
	if err := b.Publish(ctx, "q", Message{ID: "a"}); err != nil {
		t.Fatal(err)
	}
	injected := errors.New("injected")
	s := openSource(t, b, WithPollWait(10*time.Millisecond), WithFaults(Faults{Receive: func() error { return injected }}))
	if ds, err := s.Receive(ctx, 10); !errors.Is(err, injected) || len(ds) != 0 {
		t.Fatalf("Receive under a receive fault = %v, %v; want no message and the injected error", ids(ds), err)
	}
	if st, _ := b.Stats("q"); st.Received != 0 || st.Visible != 1 {
		t.Fatalf("stats %+v after a failed receive, want the message visible and never received", st)
	}
	s.SetFaults(Faults{})
	if ds := receive(t, s, 10); len(ds) != 1 || ds[0].ID != "a" || ds[0].Attempt != 1 {
		t.Fatalf("received %v once the fault was gone, want a as attempt 1", ids(ds))
	}
}

// SetFault makes Send fail for the deliveries its function refuses, writing
// nothing, as a dead-letter destination that is down does; the others, and
// every delivery once the fault is removed, are written.
func TestDeadLetterFaultRefusesTheWrite(t *testing.T) {
	b := newTestBroker(t, QueueOptions{})
	dlq, err := b.DeadLetterQueue("q")
	if err != nil {
		t.Fatal(err)
	}
	down := errors.New("dead-letter queue down")
	dlq.SetFault(func(d *adapters.Delivery) error {
		if d.ID == "refused" {
			return down
		}
		return nil
	})
	ctx := context.Background()
	failure := adapters.Failure{Err: errors.New("boom"), Attempts: 1}
	refused := &adapters.Delivery{ID: "refused", Partition: -1, Offset: -1}
	if err := dlq.Send(ctx, refused, failure); !errors.Is(err, down) {
		t.Fatalf("Send under the fault = %v, want the fault's error", err)
	}
	if err := dlq.Send(ctx, &adapters.Delivery{ID: "passed", Partition: -1, Offset: -1}, failure); err != nil {
		t.Fatalf("Send of a delivery the fault lets through = %v", err)
	}
	dlq.SetFault(nil)
	if err := dlq.Send(ctx, refused, failure); err != nil {
		t.Fatalf("Send once the fault is removed = %v", err)
	}
	dead, err := b.Messages("q")
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 2 || dead[0].ID != "passed" || dead[1].ID != "refused" {
		t.Fatalf("dead-letter queue holds %+v, want passed, then refused once the fault was removed", dead)
	}
}

// A redelivery keeps the time of the message's first receive, which the
// dead-letter diagnostics report as its first failure, whoever received it
// then: it is not reset by each receive.
func TestRedeliveryKeepsTheFirstReceiveTime(t *testing.T) {
	b := newTestBroker(t, QueueOptions{Lease: time.Hour})
	ctx := context.Background()
	if err := b.Publish(ctx, "q", Message{ID: "a"}); err != nil {
		t.Fatal(err)
	}
	first, second := openSource(t, b), openSource(t, b)
	ds := receive(t, first, 1)
	if len(ds) != 1 || !ds[0].FirstReceivedAt.Equal(ds[0].ReceivedAt) {
		t.Fatalf("first receive %v, want a, first received when received", ids(ds))
	}
	firstAt := ds[0].ReceivedAt
	if err := first.Nack(ctx, adapters.NackAll(ds, 0)); err != nil {
		t.Fatal(err)
	}
	for !time.Now().After(firstAt) { // the clock moves on, or a reset could not show
		runtime.Gosched()
	}
	again := receive(t, second, 1)
	if len(again) != 1 || again[0].Attempt != 2 {
		t.Fatalf("second receive %v, want a as attempt 2", ids(again))
	}
	if !again[0].FirstReceivedAt.Equal(firstAt) {
		t.Fatalf("redelivery's FirstReceivedAt = %v, want the first receive's %v", again[0].FirstReceivedAt, firstAt)
	}
}

// Capabilities describe the queue as created: its lease, its order (FIFO
// queues only), and the delayed nacks and broker-side delivery counts every
// memory queue has.
func TestCapabilitiesDescribeTheQueue(t *testing.T) {
	for _, fifo := range []bool{false, true} {
		b := newTestBroker(t, QueueOptions{Lease: 7 * time.Second, FIFO: fifo})
		c := openSource(t, b).Capabilities()
		if c.Name != "memory:q" || c.Lease != 7*time.Second || c.Ordered != fifo || !c.NackDelay || !c.CountsDeliveries {
			t.Errorf("FIFO %t: capabilities %+v, want memory:q, a 7s lease, Ordered %t, NackDelay and CountsDeliveries", fifo, c, fifo)
		}
	}
}

// Two messages of a FIFO group received together whose leases ran out: once
// another receiver took the first, the old holder can no longer extend the
// second. Its extension would put a second message of the group in flight,
// with another consumer, while the first is not done: the group would be
// handled out of order and side by side. (SQS fails such an extension: the
// message is not in flight.)
func TestFIFOExtensionCannotRetakeAGroupHeldByAnotherReceive(t *testing.T) {
	b, old, other, held := receiveGroupOfTwo(t)
	ctx := context.Background()
	// Both leases run out (an extension to zero, so no clock is involved).
	if err := old.Extend(ctx, held, 0); err != nil {
		t.Fatal(err)
	}
	if ds := receive(t, other, 1); len(ds) != 1 || ds[0].ID != "a1" {
		t.Fatalf("received %v, want a1", ids(ds))
	}
	err := old.Extend(ctx, held[1:], time.Hour)
	if !errors.Is(adapters.EntryError(err, 0), adapters.ErrLeaseLost) {
		t.Fatalf("extending a2 while a1 of its group is held by another receive: %v, want an error wrapping adapters.ErrLeaseLost", err)
	}
	if st, err := b.Stats("q"); err != nil || st.InFlight != 1 {
		t.Fatalf("Stats = %+v, %v; want InFlight 1: only a1 of group g may be in flight", st, err)
	}
}

// receiveGroupOfTwo publishes a1 and a2 of FIFO group g to a queue with an
// hour's lease, and receives both in one batch with holder. The other source
// polls briefly.
func receiveGroupOfTwo(t *testing.T) (b *Broker, holder, other *Source, held []*adapters.Delivery) {
	t.Helper()
	b = newTestBroker(t, QueueOptions{Lease: time.Hour, FIFO: true})
	if err := b.Publish(context.Background(), "q", Message{ID: "a1", Key: "g"}, Message{ID: "a2", Key: "g"}); err != nil {
		t.Fatal(err)
	}
	holder, other = openSource(t, b), openSource(t, b, WithPollWait(10*time.Millisecond))
	held = receive(t, holder, 10)
	if got := ids(held); len(got) != 2 || got[0] != "a1" || got[1] != "a2" {
		t.Fatalf("received %v, want a1 and a2 in one batch", got)
	}
	return b, holder, other, held
}

// A FIFO message whose lease ran out while its group stayed held (another
// message of its batch is in flight), then extended by its holder for a
// moment, becomes visible again when that moment ends. A receiver already
// waiting for the group must get it then, not when its poll ends: the
// extension moved the next visibility time earlier than it knew.
func TestFIFOShortExtensionAfterTheLeaseRanOutWakesWaitingReceiver(t *testing.T) {
	b, holder, _, held := receiveGroupOfTwo(t)
	ctx := context.Background()
	// a2's lease runs out (an extension to zero, so no clock is involved);
	// a1 keeps the group.
	if err := holder.Extend(ctx, held[1:], 0); err != nil {
		t.Fatal(err)
	}
	got := receiveInBackground(t, b, openSource(t, b, WithPollWait(time.Hour)))
	if err := holder.Extend(ctx, held[1:], 10*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if err := holder.Ack(ctx, held[:1]); err != nil {
		t.Fatal(err)
	}
	if ds := <-got; !slices.Equal(ids(ds), []string{"a2"}) {
		t.Fatalf("waiting receiver got %v once a2's short extension ended, want [a2]", ids(ds))
	}
}
