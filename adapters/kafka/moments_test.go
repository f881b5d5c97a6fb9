package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// Rebalances at bad moments, through the runtime. Each test revokes the
// partition of a single member and assigns it back at once (an eager
// balancer and ForceRebalance), at a moment where something of the
// partition is under way, and checks the outcome: nothing lost, nothing run
// again that was done before the revoke (the commit and its metadata cover
// it), the partition's order kept, and the group committed at the end.

// eagerRevoke forces a rebalance of s's group, in which s (an eager member)
// revokes all its partitions and gets them back; it returns once the revoke
// drain of partition part has begun.
func eagerRevoke(t *testing.T, s *Source, topic string, part int32) *partition {
	t.Helper()
	s.mu.Lock()
	p := s.parts[tpKey{topic, part}]
	s.mu.Unlock()
	if p == nil {
		t.Fatalf("%s/%d is not assigned", topic, part)
	}
	s.Client().ForceRebalance()
	eventually(t, "the revoke drain to begin", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return p.draining || p.fenced
	})
	return p
}

// runLog records the handler's runs of one partition, in start order.
type runLog struct {
	mu   sync.Mutex
	runs []int64
	// open counts the runs under way per ordering key.
	open    map[string]int
	overlap []string
}

func (l *runLog) start(key string, off int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.open == nil {
		l.open = map[string]int{}
	}
	l.runs = append(l.runs, off)
	l.open[key]++
	if l.open[key] > 1 {
		l.overlap = append(l.overlap, fmt.Sprintf("%s@%d", key, off))
	}
}

func (l *runLog) end(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.open[key]--
}

func (l *runLog) get() []int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.runs)
}

func (l *runLog) count(off int64) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, o := range l.runs {
		if o == off {
			n++
		}
	}
	return n
}

func seq(from, to int64) []int64 {
	var out []int64
	for o := from; o <= to; o++ {
		out = append(out, o)
	}
	return out
}

// A revoke while a record's retry waits in place (an hour's backoff, with an
// hour's revoke drain): the recall ends the wait at once, the record is
// given back undone, and the revoke's commit stops before it. Assigned back,
// the partition runs the record and the ones behind it once each and in
// order; the records done before the revoke are not run again.
func TestRevokeWhileARetryWaitsInPlace(t *testing.T) {
	const n = 10
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, n, n)
	group := newGroup()
	s := c.open(t, group, "orders", WithCommitInterval(20*time.Millisecond), WithRevokeDrain(time.Hour),
		WithClientOptions(kgo.Balancers(kgo.RangeBalancer())))
	var log runLog
	failed := make(chan struct{})
	var once sync.Once
	runConsumer(t, s, func(ctx context.Context, m *consumer.Message) error {
		log.start("", m.Offset)
		defer log.end("")
		if m.Offset == 3 {
			first := false
			once.Do(func() { first = true; close(failed) })
			if first {
				return errors.New("transient")
			}
		}
		return nil
	}, consumer.WithRetry(consumer.Retry{MaxAttempts: 5, Backoff: consumer.ConstantBackoff(time.Hour)}),
		consumer.WithConcurrency(4))

	await(t, "offset 3 to fail", failed)
	eventually(t, "the commit to reach the waiting retry", func() bool {
		offs, _ := c.committed(t, group, "orders")
		return offs[0] == 3
	})
	start := time.Now()
	eagerRevoke(t, s, "orders", 0)
	eventually(t, "the partition to run to its end after the revoke", func() bool {
		return log.count(n-1) >= 1
	})
	if d := time.Since(start); d > 20*time.Second {
		t.Errorf("the revoke took %v: it waited for the retry's backoff or its drain time", d)
	}
	if got, want := log.get(), append(seq(0, 3), seq(3, n-1)...); !slices.Equal(got, want) {
		t.Errorf("ran %v, want %v: 0..2 once, 3 failing then again after the revoke, the rest once in order", got, want)
	}
	eventually(t, "the commit at the end", func() bool {
		offs, _ := c.committed(t, group, "orders")
		return offs[0] == n
	})
}

// blockingDeadLetter holds each Send until release is closed, then produces
// through next.
type blockingDeadLetter struct {
	next    adapters.DeadLetter
	started chan struct{}
	once    sync.Once
	release chan struct{}
	mu      sync.Mutex
	sent    []int64
}

func (b *blockingDeadLetter) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	b.once.Do(func() { close(b.started) })
	select {
	case <-b.release:
	case <-ctx.Done():
		return ctx.Err()
	}
	err := b.next.Send(ctx, d, f)
	if err == nil {
		b.mu.Lock()
		b.sent = append(b.sent, d.Offset)
		b.mu.Unlock()
	}
	return err
}

func (b *blockingDeadLetter) sentOffsets() []int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.sent)
}

// A revoke while a dead-letter produce is under way. Finished within the
// revoke drain, the record counts as done: the revoke commits past it and
// nothing is sent or run twice. Still under way after the drain, the record
// is given up undone: the commit stays before it, the records behind it are
// not lost, the produce is cut short with the loss (the runtime ends a
// dead-letter write when its delivery is lost, as it ends a handler), and
// the record is dead-lettered once, after the partition is assigned back.
func TestRevokeWhileADeadLetterProduceIsUnderWay(t *testing.T) {
	for _, tc := range []struct {
		name        string
		drain       time.Duration
		withinDrain bool
	}{
		{"finished within the drain", time.Hour, true},
		{"finished after the drain", 300 * time.Millisecond, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const n = 10
			c := newCluster(t)
			c.createTopic(t, "orders", 1)
			c.createTopic(t, "orders.dlq", 1)
			c.produceN(t, "orders", 1, n, n)
			group := newGroup()
			s := c.open(t, group, "orders", WithCommitInterval(20*time.Millisecond), WithRevokeDrain(tc.drain),
				WithClientOptions(kgo.Balancers(kgo.RangeBalancer())))
			sink := sinkOf(t, s, "orders.dlq")
			dl := &blockingDeadLetter{next: sink, started: make(chan struct{}), release: make(chan struct{})}
			var log runLog
			stop := runConsumer(t, s, func(ctx context.Context, m *consumer.Message) error {
				log.start("", m.Offset)
				defer log.end("")
				if m.Offset == 3 {
					return consumer.Permanent(errors.New("poison"))
				}
				return nil
			}, consumer.WithDeadLetter(dl), consumer.WithConcurrency(4))
			defer stop()

			await(t, "the dead-letter produce to start", dl.started)
			p := eagerRevoke(t, s, "orders", 0)
			if tc.withinDrain {
				close(dl.release)
			} else {
				eventually(t, "the revoke to give the record up", func() bool {
					s.mu.Lock()
					defer s.mu.Unlock()
					return p.fenced
				})
				if offs, _ := c.committed(t, group, "orders"); offs[0] > 3 {
					t.Fatalf("the revoke committed %d past the record whose dead-letter produce was under way", offs[0])
				}
				close(dl.release)
			}
			eventually(t, "the commit at the end", func() bool {
				offs, _ := c.committed(t, group, "orders")
				return offs[0] == n
			})
			runs := log.get()
			if tc.withinDrain {
				if want := seq(0, n-1); !slices.Equal(runs, want) {
					t.Errorf("ran %v, want each record once in order: %v", runs, want)
				}
				if got := dl.sentOffsets(); !slices.Equal(got, []int64{3}) {
					t.Errorf("dead-lettered %v, want [3] once", got)
				}
				return
			}
			if want := append(seq(0, 3), seq(3, n-1)...); !slices.Equal(runs, want) {
				t.Errorf("ran %v, want %v: 0..3, then from 3 again after the revoke", runs, want)
			}
			if got := dl.sentOffsets(); !slices.Equal(got, []int64{3}) {
				t.Errorf("dead-lettered %v, want [3] once: the given-up produce cut short, then the new assignment's", got)
			}
		})
	}
}

// A revoke while a commit is under way (the broker holds the interval's
// commit until the revoke has begun and more records were done): the revoke's
// own commit goes after it, the group ends at the revoke's done prefix, not
// the stale one, and the partition assigned back runs none of the records
// done before the revoke.
func TestRevokeWhileACommitIsUnderWay(t *testing.T) {
	const n = 10
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, n, n)
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour), WithRevokeDrain(time.Hour),
		WithClientOptions(kgo.Balancers(kgo.RangeBalancer())))
	ds := receiveN(t, s, n)
	ack(t, s, ds[:3]...)

	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	c.fake.ControlKey(int16(kmsg.OffsetCommit), func(kmsg.Request) (kmsg.Response, error, bool) {
		once.Do(func() { close(held) })
		c.fake.SleepControl(func() { <-release })
		return nil, nil, false
	})
	committed := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		committed <- s.Commit(ctx)
	}()
	await(t, "the commit to reach the broker", held)
	eagerRevoke(t, s, "orders", 0)
	ack(t, s, ds[3:6]...) // done within the drain
	if err := s.Nack(context.Background(), adapters.NackAll(ds[6:], 0)); err != nil {
		t.Fatal(err)
	}
	close(release)
	if err := <-committed; err != nil {
		t.Logf("the commit held across the revoke failed: %v", err)
	}
	got := receiveN(t, s, n-6)
	if o := offsets(got); !slices.Equal(o, seq(6, n-1)) {
		t.Fatalf("assigned back, received %v, want only the records not done: %v", o, seq(6, n-1))
	}
	if offs, _ := c.committed(t, group, "orders"); offs[0] != 6 {
		t.Fatalf("committed %d after the revoke, want its done prefix 6", offs[0])
	}
}

// By key, a revoke and assignment back to the same member while a record's
// handler ignores its context and runs past the drain: the record is given
// up and fetched again, but its key's records never run concurrently on the
// member, and each key's runs after the revoke follow the offsets; the
// records of other keys are not held up by the revoke beyond it. (The
// runtime's in-flight bound is set well above what the slow key holds: see
// TestRevokedLaneBehindAHandlerPastTheDrainHoldsNoCredit for what happens
// near it.)
func TestByKeyOrderAcrossARevokeWithAHandlerRunningPastTheDrain(t *testing.T) {
	const n, keys = 30, 3
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, n, keys) // key-<offset % 3>
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(ByKey), WithCommitInterval(20*time.Millisecond), WithRevokeDrain(200*time.Millisecond),
		WithClientOptions(kgo.Balancers(kgo.RangeBalancer())))
	var mu sync.Mutex
	perKey := map[string][]int64{}
	var log runLog
	slow, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	runConsumer(t, s, func(ctx context.Context, m *consumer.Message) error {
		log.start(m.Key, m.Offset)
		defer log.end(m.Key)
		mu.Lock()
		perKey[m.Key] = append(perKey[m.Key], m.Offset)
		mu.Unlock()
		if m.Offset == 4 {
			first := false
			once.Do(func() { first = true; close(slow) })
			if first {
				<-release // ignores its context
			}
		}
		return nil
	}, consumer.WithConcurrency(8), consumer.WithMaxInFlight(64))

	await(t, "offset 4 to start its slow run", slow)
	p := eagerRevoke(t, s, "orders", 0)
	eventually(t, "the revoke to give up the slow record", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return p.fenced
	})
	// The other keys go on after the revoke while key-1 waits for offset 4.
	eventually(t, "the other keys to run to the end", func() bool {
		return log.count(n-1) >= 1 && log.count(n-3) >= 1 // key-2's last, key-0's last
	})
	close(release)
	eventually(t, "the commit at the end", func() bool {
		offs, _ := c.committed(t, group, "orders")
		return offs[0] == n
	})
	log.mu.Lock()
	if len(log.overlap) > 0 {
		t.Errorf("records of one key ran concurrently: %v", log.overlap)
	}
	log.mu.Unlock()
	mu.Lock()
	defer mu.Unlock()
	for k := 0; k < keys; k++ {
		key := fmt.Sprintf("key-%d", k)
		runs := perKey[key]
		// The key's offsets in order, from the first; at most one step
		// back (the partition fetched again after the revoke), after
		// which they go on in order again to the key's last record.
		var want []int64
		for o := int64(k); o < n; o += keys {
			want = append(want, o)
		}
		cut := len(runs)
		for i := 1; i < len(runs); i++ {
			if runs[i] <= runs[i-1] {
				cut = i
				break
			}
		}
		before, after := runs[:cut], runs[cut:]
		ok := len(before) > 0 && slices.Equal(before, want[:min(len(before), len(want))])
		if len(after) > 0 {
			i := slices.Index(want, after[0])
			ok = ok && i >= 0 && slices.Equal(after, want[i:])
		} else {
			ok = ok && slices.Equal(before, want)
		}
		if !ok {
			t.Errorf("%s ran %v; want %v in order, with at most one step back after which it runs in order to the end", key, runs, want)
		}
	}
}

// At the metadata bound: a partition takes records until its worst-case
// metadata would outgrow the limit; with its first record not done and
// every other record behind it done (the pattern that makes the most runs),
// the revoke commits metadata listing all the done ones. (Consecutive
// offsets keep it near half the limit: the bound assumes every tracked
// offset could be a run of its own.) Assigned back, the partition hands out
// exactly the records that were not done (the first, the ones between the
// done ones, and those never taken), and none that was listed done.
func TestMetadataAtItsBoundSkipsExactlyTheDoneRecords(t *testing.T) {
	const n = 4000
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, n, 1)
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour), WithRevokeDrain(time.Hour),
		WithMaxUnackedPerPartition(n), WithMaxUnacked(n),
		WithClientOptions(kgo.Balancers(kgo.RangeBalancer())))
	// Take what the bound lets the partition track.
	ds := receiveN(t, s, 1)
	for {
		got := receiveFor(t, s, 300*time.Millisecond)
		if len(got) == 0 {
			break
		}
		ds = append(ds, got...)
	}
	if len(ds) < 100 || len(ds) >= n {
		t.Fatalf("took %d records; want the metadata bound to stop the partition well before %d", len(ds), n)
	}
	var done, undone []*adapters.Delivery
	for i, d := range ds {
		if i > 0 && i%2 == 0 {
			done = append(done, d)
		} else {
			undone = append(undone, d)
		}
	}
	ack(t, s, done...)
	eagerRevoke(t, s, "orders", 0)
	if err := s.Nack(context.Background(), adapters.NackAll(undone, 0)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the revoke to commit", func() bool {
		offs, _ := c.committed(t, group, "orders")
		return offs[0] == 0
	})
	_, metas := c.committed(t, group, "orders")
	if len(metas[0]) > DefaultMetadataLimit {
		t.Fatalf("commit metadata of %d bytes, over the limit", len(metas[0]))
	}
	t.Logf("took %d records, %d done; metadata %d bytes", len(ds), len(done), len(metas[0]))
	doneSet := map[int64]bool{}
	for _, d := range done {
		doneSet[d.Offset] = true
	}
	var want []int64
	for o := int64(0); o < n; o++ {
		if !doneSet[o] {
			want = append(want, o)
		}
	}
	var got []int64
	deadline := time.Now().Add(60 * time.Second)
	for len(got) < len(want) && time.Now().Before(deadline) {
		batch := receiveFor(t, s, 200*time.Millisecond)
		got = append(got, offsets(batch)...)
		ack(t, s, batch...)
	}
	slices.Sort(got)
	if !slices.Equal(got, want) {
		var again []int64
		for _, o := range got {
			if doneSet[o] {
				again = append(again, o)
			}
		}
		t.Fatalf("assigned back, received %d records, want %d; done records handed out again: %v", len(got), len(want), again)
	}
	commitNow(t, s)
	if offs, _ := c.committed(t, group, "orders"); offs[0] != n {
		t.Fatalf("committed %d, want %d", offs[0], n)
	}
}

// A record whose handler ignores its context holds its key's lane; its
// key's records received behind it wait in the runtime, the other keys go
// on. Here the runtime's in-flight bound (20) is above what the slow key's
// records take (9), so the other keys' records produced later run while the
// slow handler runs on, with or without a revoke in between.
//
// After a revoke gives up the slow record at the end of its drain, the
// records of its lane queued behind it must be given back. Were they linked
// behind it for the worker to run next (run.next took up to laneRun at
// once), they were out of reach of the recall: lost, they stayed held until
// the slow handler returned, the partition's records fetched again once it
// was assigned back piled up behind them, the runtime's credit ran out and
// every key of the member waited for the handler that ignores its context.
func TestRevokedLaneBehindAHandlerPastTheDrainHoldsNoCredit(t *testing.T) {
	for _, revoke := range []bool{false, true} {
		t.Run(fmt.Sprintf("revoke=%v", revoke), func(t *testing.T) {
			const n, keys = 30, 3
			c := newCluster(t)
			c.createTopic(t, "orders", 1)
			c.produceN(t, "orders", 1, n, keys)
			group := newGroup()
			s := c.open(t, group, "orders", WithOrderingScope(ByKey), WithCommitInterval(20*time.Millisecond), WithRevokeDrain(200*time.Millisecond),
				WithClientOptions(kgo.Balancers(kgo.RangeBalancer())))
			var log runLog
			slow, release := make(chan struct{}), make(chan struct{})
			var once sync.Once
			runConsumer(t, s, func(ctx context.Context, m *consumer.Message) error {
				log.start(m.Key, m.Offset)
				defer log.end(m.Key)
				if m.Offset == 4 {
					first := false
					once.Do(func() { first = true; close(slow) })
					if first {
						<-release // ignores its context
					}
				}
				return nil
			}, consumer.WithConcurrency(8), consumer.WithMaxInFlight(20))
			defer close(release)
			await(t, "offset 4 to start its slow run", slow)
			eventually(t, "the other keys to run to the end", func() bool {
				return log.count(n-1) >= 1 && log.count(n-3) >= 1
			})
			if revoke {
				p := eagerRevoke(t, s, "orders", 0)
				eventually(t, "the revoke to give up the slow record", func() bool {
					s.mu.Lock()
					defer s.mu.Unlock()
					return p.fenced
				})
			}
			// More records of the other keys.
			c.produce(t,
				&kgo.Record{Topic: "orders", Key: []byte("key-0"), Value: []byte("late")},
				&kgo.Record{Topic: "orders", Key: []byte("key-2"), Value: []byte("late")})
			eventually(t, "the other keys' later records to run while the slow handler runs on", func() bool {
				return log.count(n) >= 1 && log.count(n+1) >= 1
			})
		})
	}
}

// Shutdown during a revoke's drain while a handler runs: Run's context is
// cancelled, so the runtime stops receiving, lets the handler run until the
// shutdown timeout (1s), cuts it, gives its record back, and returns; the
// revoke then commits the done prefix, before the record that did not
// finish.
//
// franz-go blocks every PollRecords while a rebalance is under way (the
// wait ignores the poll's context), and the revoke waits for the runtime's
// running handlers: the runtime's receiver, inside Receive, does not see
// its context end until the revoke drain (20s here) gives the record up.
// The shutdown timeout must not wait for it: the handler's context is cut
// by the shutdown timeout (ErrShutdownTimeout), not by the revoke.
func TestShutdownDuringARevokeDrain(t *testing.T) {
	const n = 10
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, n, n)
	group := newGroup()
	s := c.open(t, group, "orders", WithCommitInterval(20*time.Millisecond), WithRevokeDrain(20*time.Second),
		WithClientOptions(kgo.Balancers(kgo.RangeBalancer())))
	var log runLog
	started := make(chan struct{})
	cut := make(chan error, 1)
	stop := runConsumer(t, s, func(ctx context.Context, m *consumer.Message) error {
		log.start("", m.Offset)
		defer log.end("")
		if m.Offset == 3 {
			close(started)
			<-ctx.Done()
			cut <- context.Cause(ctx)
			return ctx.Err()
		}
		return nil
	}, consumer.WithShutdownTimeout(time.Second), consumer.WithConcurrency(4))
	await(t, "offset 3 to start", started)
	eventually(t, "the commit to reach the running record", func() bool {
		offs, _ := c.committed(t, group, "orders")
		return offs[0] == 3
	})
	eagerRevoke(t, s, "orders", 0)
	stop()
	if cause := <-cut; !errors.Is(cause, consumer.ErrShutdownTimeout) {
		t.Errorf("the running handler was cut with cause %v, want ErrShutdownTimeout: the shutdown waited for the revoke drain", cause)
	}
	if got := log.get(); !slices.Equal(got, seq(0, 3)) {
		t.Errorf("ran %v, want 0..3", got)
	}
	if offs, _ := c.committed(t, group, "orders"); offs[0] != 3 {
		t.Errorf("committed %d, want 3: the record cut at shutdown is not done", offs[0])
	}
}
