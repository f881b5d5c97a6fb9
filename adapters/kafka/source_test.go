package kafka

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

func TestInvalidOptionsNameTheOption(t *testing.T) {
	cases := map[string][]Option{
		"WithBrokers":                  {WithGroup("g"), WithTopics("t")},
		"WithGroup":                    {WithBrokers("b:9092"), WithTopics("t")},
		"WithTopics":                   {WithBrokers("b:9092"), WithGroup("g")},
		"WithOrderingScope":            {WithBrokers("b:9092"), WithGroup("g"), WithTopics("t"), WithOrderingScope(OrderingScope(7))},
		"WithCommitInterval":           {WithCommitInterval(0)},
		"WithCommitLinger(2s) exceeds": {WithBrokers("b:9092"), WithGroup("g"), WithTopics("t"), WithCommitLinger(2 * time.Second)},
		"WithMaxUnackedPerPartition":   {WithMaxUnackedPerPartition(0)},
		"WithMaxUnacked(":              {WithBrokers("b:9092"), WithGroup("g"), WithTopics("t"), WithMaxUnacked(2), WithMaxUnackedPerPartition(3)},
		"WithMetadataLimit":            {WithMetadataLimit(8)},
		"WithRevokeDrain":              {WithRevokeDrain(-time.Second)},
		"WithPollWait":                 {WithPollWait(0)},
		"WithLagRefresh":               {WithLagRefresh(-time.Second)},
	}
	for name, opts := range cases {
		_, err := New(context.Background(), opts...)
		if err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s: got error %v, want one naming the option", name, err)
		}
	}
	// Values each option refuses by itself, with the required ones valid.
	required := []Option{WithBrokers("b:9092"), WithGroup("g"), WithTopics("t")}
	for _, c := range []struct {
		want string
		opt  Option
	}{
		{"WithBrokers: give at least one", WithBrokers()},
		{"WithBrokers: empty broker address", WithBrokers("b:9092", "")},
		{"WithGroup: the group name must not be empty", WithGroup("")},
		{"WithTopics: give at least one", WithTopics()},
		{"WithTopics: empty topic name", WithTopics("t", "")},
		{"WithClientFactory: nil", WithClientFactory(nil)},
		{"WithCommitTimeout(0s)", WithCommitTimeout(0)},
		{"WithCommitLinger(-1ns): must not be negative", WithCommitLinger(-1)},
		{"WithMaxUnacked(0)", WithMaxUnacked(0)},
		{"WithMeterProvider: nil", WithMeterProvider(nil)},
	} {
		_, err := New(context.Background(), append(slices.Clone(required), c.opt)...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("got error %v, want one saying %q", err, c.want)
		}
	}
	// A client the factory cannot make fails New with its reason.
	refused := errors.New("no TLS configuration")
	_, err := New(context.Background(), append(slices.Clone(required), WithClientFactory(func(...kgo.Opt) (*kgo.Client, error) { return nil, refused }))...)
	if !errors.Is(err, refused) {
		t.Errorf("New with a failing client factory = %v, want its error", err)
	}
	// The dead-letter sink: its topic and brokers are required, and the
	// options of a Source alone are refused by name, not ignored.
	for want, c := range map[string]struct {
		topic string
		opts  []Option
	}{
		"the topic must not be empty":    {"", []Option{WithBrokers("b:9092")}},
		"WithBrokers is required":        {"dlq", nil},
		"WithTopics only apply":          {"dlq", []Option{WithBrokers("b:9092"), WithTopics("t")}},
		"WithCommitLinger only apply":    {"dlq", []Option{WithBrokers("b:9092"), WithCommitLinger(0)}},
		"WithMeterProvider only apply":   {"dlq", []Option{WithBrokers("b:9092"), WithMeterProvider(noop.NewMeterProvider())}},
		"WithClientFactory: nil factory": {"dlq", []Option{WithBrokers("b:9092"), WithClientFactory(nil)}},
	} {
		if _, err := NewDeadLetter(context.Background(), c.topic, c.opts...); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("NewDeadLetter(%q, ...) = %v, want an error saying %q", c.topic, err, want)
		}
	}
}

// One slow record holds the committed offset back while later records
// finish; once it finishes the commit jumps past all of them.
func TestOutOfOrderCompletionCommitsOnlyTheDonePrefix(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 20, 20)
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(10*time.Millisecond))

	ds := receiveN(t, s, 20)
	var slow *adapters.Delivery
	for _, d := range ds {
		if d.Offset == 3 {
			slow = d
			continue
		}
		ack(t, s, d)
	}
	// The commit loop runs every 10ms; watch it for a while. A tick during
	// the acks above commits 3 with only the records acked by then in the
	// metadata: wait for the commit that records the last one done.
	var lastMeta string
	eventually(t, "the prefix before the slow record to be committed, with offset 19 recorded done", func() bool {
		offs, metas := c.committed(t, group, "orders")
		lastMeta = metas[0]
		spans := decodeDone(lastMeta, 3, -1)
		return offs[0] == 3 && len(spans) > 0 && spans[len(spans)-1].to == 19
	})
	for i := 0; i < 20; i++ {
		offs, _ := c.committed(t, group, "orders")
		if offs[0] > 3 {
			t.Fatalf("committed %d past the unfinished offset 3", offs[0])
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got := decodeDone(lastMeta, 3, -1); !slices.Equal(got, []span{{4, 19, 0}}) {
		t.Fatalf("metadata records done spans %v, want [{4 19}]", got)
	}
	ack(t, s, slow)
	eventually(t, "the commit to jump past every finished record", func() bool {
		offs, _ := c.committed(t, group, "orders")
		return offs[0] == 20
	})
}

// Done offsets beyond the committed one are recorded in the commit metadata;
// the partition's next owner skips them.
func TestMetadataSkipsDoneRecordsAfterReassignment(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 10, 10)
	group := newGroup()

	a := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	ds := receiveN(t, a, 10)
	for _, d := range ds {
		if d.Offset != 0 && d.Offset != 5 {
			ack(t, a, d)
		}
	}
	if err := a.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	offs, _ := c.committed(t, group, "orders")
	if offs[0] != 0 {
		t.Fatalf("committed %d, want 0 (offset 0 never finished)", offs[0])
	}

	reader, mp := newMeter(t)
	b := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour), WithMeterProvider(mp))
	got := receiveN(t, b, 2)
	if more := receiveFor(t, b, 500*time.Millisecond); len(more) > 0 {
		got = append(got, more...)
	}
	if o := offsets(got); !slices.Equal(o, []int64{0, 5}) {
		t.Fatalf("new owner received offsets %v, want only the unfinished [0 5]", o)
	}
	skipped, _ := collect(t, reader, "custody.kafka.skipped").(metricdata.Sum[int64])
	if len(skipped.DataPoints) != 1 || skipped.DataPoints[0].Value != 8 {
		t.Fatalf("custody.kafka.skipped = %+v, want the 8 records the first owner did", skipped)
	}
	ack(t, b, got...)
	commitNow(t, b)
	if offs, _ := c.committed(t, group, "orders"); offs[0] != 10 {
		t.Fatalf("committed %d after finishing, want 10", offs[0])
	}
}

// An owner revoked before it reached the offsets a previous owner recorded
// done passes them on in its own commit metadata: a second rebalance does not
// run them again.
func TestMetadataSurvivesAnOwnerThatDidNotReachIt(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 100, 100)
	group := newGroup()

	a := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	for _, d := range receiveN(t, a, 100) {
		if d.Offset != 0 {
			ack(t, a, d)
		}
	}
	if err := a.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}

	// b holds at most two records, so it polls no further than offset 1
	// before it is closed, with offset 0 still unfinished.
	b := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour),
		WithMaxUnacked(2), WithMaxUnackedPerPartition(2))
	if got := offsets(receiveN(t, b, 1)); !slices.Equal(got, []int64{0}) {
		t.Fatalf("second owner received %v, want [0]", got)
	}
	// One more call: it skips what the previous owner did, so b has done
	// records of its own to commit.
	if ds, err := b.Receive(context.Background(), 1); err != nil || len(ds) > 0 {
		t.Fatalf("second owner received %v, %v; want nothing", offsets(ds), err)
	}
	commitNow(t, b)
	if err := b.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	offs, metas := c.committed(t, group, "orders")
	if offs[0] != 0 {
		t.Fatalf("committed %d, want 0 (offset 0 never finished)", offs[0])
	}
	if got := decodeDone(metas[0], 0, -1); !slices.Equal(got, []span{{1, 99, 0}}) {
		t.Fatalf("second owner's metadata records %v, want [{1 99}]", got)
	}

	c3 := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	got := receiveN(t, c3, 1)
	got = append(got, receiveFor(t, c3, 500*time.Millisecond)...)
	if o := offsets(got); !slices.Equal(o, []int64{0}) {
		t.Fatalf("third owner received offsets %v, want only the unfinished [0]", o)
	}
}

// A partition whose done offsets could outgrow the metadata limit stops
// taking records, and fetching, until its prefix catches up; then the room
// comes back, round after round.
func TestMetadataLimitStopsTakingRecords(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 50, 50)
	s := c.open(t, newGroup(), "orders", WithOrderingScope(Unordered), WithMetadataLimit(32))

	first := receiveN(t, s, 1)
	first = append(first, receiveFor(t, s, time.Second)...)
	if len(first) > 4 {
		t.Fatalf("received %d records with a 32-byte metadata limit, want 1 to 4", len(first))
	}
	// Finish everything but the head: the metadata now records them, and
	// still nothing more may be taken.
	ack(t, s, first[1:]...)
	if more := receiveFor(t, s, 500*time.Millisecond); len(more) > 0 {
		t.Fatalf("took %d more records while the head was unfinished", len(more))
	}
	// Nor does it fetch records it could not take.
	if paused := s.Client().PauseFetchPartitions(nil); len(paused) == 0 {
		t.Fatal("the partition that can take no records is still fetched")
	}
	ack(t, s, first[0])
	// The positions the prefix passed give their room back: with all taken
	// before done, two records fit again, round after round.
	seen := len(first)
	for seen < 50 {
		ds := receiveN(t, s, min(2, 50-seen))
		seen += len(ds)
		ack(t, s, ds...)
	}
}

// At the per-partition bound the partition's fetching is paused and no more
// records are handed out; acks resume it.
func TestBackpressurePerPartitionAndTotal(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 4)
	c.produceN(t, "orders", 4, 30, 30)
	s := c.open(t, newGroup(), "orders", WithOrderingScope(Unordered), WithMaxUnackedPerPartition(3), WithMaxUnacked(10))

	got := receiveN(t, s, 10)
	if more := receiveFor(t, s, 500*time.Millisecond); len(more) > 0 {
		t.Fatalf("handed out %d records beyond the total bound of 10", len(more))
	}
	per := map[int32]int{}
	for _, d := range got {
		per[d.Partition]++
		if per[d.Partition] > 3 {
			t.Fatalf("partition %d has %d records in flight, bound is 3", d.Partition, per[d.Partition])
		}
	}
	paused := s.Client().PauseFetchPartitions(nil)["orders"]
	for p, n := range per {
		if n == 3 && !slices.Contains(paused, p) {
			t.Errorf("partition %d at its bound is not paused (paused: %v)", p, paused)
		}
	}
	ack(t, s, got...)
	total := len(got)
	for total < 120 {
		ds := receiveN(t, s, 1)
		total += len(ds)
		ack(t, s, ds...)
	}
	if paused := s.Client().PauseFetchPartitions(nil); len(paused) != 0 {
		t.Errorf("partitions still paused after draining: %v", paused)
	}
}

// A Source closed without acking what it held commits nothing for it; the
// next one resumes from the last committed offset.
func TestClosedWithoutCommitResumesFromCommitted(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 20, 20)
	group := newGroup()

	a := c.open(t, group, "orders", WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	ds := receiveN(t, a, 20)
	ack(t, a, ds[:5]...)
	commitNow(t, a)
	ack(t, a, ds[10:]...) // done beyond the prefix but never committed
	var lost error
	ds[7].Signal.OnLost(func(err error) { lost = err })
	// Simulate the process dying: the interval commit never runs again and
	// Close is the only thing that happens.
	a.mu.Lock()
	for _, p := range a.order {
		p.dirty = false
	}
	a.mu.Unlock()
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(lost, adapters.ErrClosed) {
		t.Fatalf("held delivery lost with %v, want ErrClosed", lost)
	}
	if offs, _ := c.committed(t, group, "orders"); offs[0] != 5 {
		t.Fatalf("committed %d, want 5", offs[0])
	}

	b := c.open(t, group, "orders", WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	got := receiveN(t, b, 15)
	if got[0].Offset != 5 || got[14].Offset != 19 {
		t.Fatalf("resumed with offsets %v, want 5..19", offsets(got))
	}
}

// Close commits the done prefixes and reports it when that commit fails:
// the records done since the last commit are then run again by the
// partitions' next owners, and the program should say so.
func TestCloseReportsAFailedCommit(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 3, 3)
	s := c.open(t, newGroup(), "orders", WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	ack(t, s, receiveN(t, s, 3)...)
	c.refuseCommits(true)
	if err := s.Close(); !errors.Is(err, kerr.GroupAuthorizationFailed) {
		t.Fatalf("Close = %v with every commit refused, want the coordinator's error", err)
	}
}

func TestOrderingKeys(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 2)
	c.produce(t,
		&kgo.Record{Topic: "orders", Partition: 1, Key: []byte("a"), Value: []byte("1"), Headers: []kgo.RecordHeader{{Key: "traceparent", Value: []byte("00-abc-def-01")}}},
		&kgo.Record{Topic: "orders", Partition: 1, Value: []byte("2")},
	)
	want := map[OrderingScope][2]string{
		ByPartition: {"orders/1", "orders/1"},
		ByKey:       {"orders/1/a", "orders/1"},
		Unordered:   {"", ""},
	}
	for mode, keys := range want {
		s := c.open(t, newGroup(), "orders", WithOrderingScope(mode))
		ds := receiveN(t, s, 2)
		if ds[0].OrderingKey != keys[0] || ds[1].OrderingKey != keys[1] {
			t.Errorf("%v: ordering keys %q %q, want %q %q", mode, ds[0].OrderingKey, ds[1].OrderingKey, keys[0], keys[1])
		}
		if ds[0].ID != "orders/1/0" || ds[0].Key != "a" || ds[0].Headers["traceparent"] != "00-abc-def-01" {
			t.Errorf("%v: delivery %+v does not carry the record's id, key and headers", mode, ds[0])
		}
		var r *kgo.Record
		if !ds[0].As(&r) || string(r.Value) != "1" {
			t.Errorf("%v: As(*kgo.Record) does not reach the record", mode)
		}
		if s.Capabilities().Ordered != (mode != Unordered) {
			t.Errorf("%v: Capabilities.Ordered = %v", mode, s.Capabilities().Ordered)
		}
		_ = s.Close()
	}
}

// Nack hands the record out again and never commits it.
func TestNackRedeliversAndHoldsThePrefix(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 3, 3)
	group := newGroup()
	s := c.open(t, group, "orders", WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	ds := receiveN(t, s, 3)
	if err := s.Nack(context.Background(), adapters.NackAll(ds[:1], 0)); err != nil {
		t.Fatal(err)
	}
	ack(t, s, ds[1:]...)
	commitNow(t, s)
	if offs, _ := c.committed(t, group, "orders"); offs[0] != 0 {
		t.Fatalf("committed %d past a nacked record", offs[0])
	}
	again := receiveN(t, s, 1)
	if again[0].Offset != 0 {
		t.Fatalf("redelivered offset %d, want 0", again[0].Offset)
	}
	ack(t, s, again...)
	commitNow(t, s)
	if offs, _ := c.committed(t, group, "orders"); offs[0] != 3 {
		t.Fatalf("committed %d, want 3", offs[0])
	}
}

// Commits carry the leader epoch of the last record they cover, as
// franz-go's own commits do, so that the partition's next owner can detect a
// log truncated under the commit (KIP-320) instead of reading past it.
func TestCommitsCarryTheLeaderEpochOfTheirLastRecord(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 3, 3) // offsets 0..2 under the first epoch
	// Moving the partition to its own broker (kfake has one) bumps its
	// leader epoch.
	if err := c.fake.MoveTopicPartition("orders", 0, 0); err != nil {
		t.Fatal(err)
	}
	c.produceN(t, "orders", 1, 3, 3) // offsets 3..5 under the next one
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	ds := receiveN(t, s, 6)
	epochOf := func(off int64) int32 {
		for _, d := range ds {
			if d.Offset == off {
				return d.Native.(*kgo.Record).LeaderEpoch
			}
		}
		t.Fatalf("offset %d not received", off)
		return 0
	}
	if epochOf(2) == epochOf(3) {
		t.Fatalf("the leader move did not change the epoch (%d): the test cannot tell epochs apart", epochOf(2))
	}
	committedEpoch := func() (int64, int32) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		resp, err := c.admin.FetchOffsets(ctx, group)
		if err != nil {
			t.Fatal(err)
		}
		o, _ := resp.Lookup("orders", 0)
		return o.At, o.LeaderEpoch
	}
	for _, upTo := range []int{3, 6} {
		ack(t, s, ds[upTo-3:upTo]...)
		commitNow(t, s)
		at, epoch := committedEpoch()
		if want := epochOf(int64(upTo - 1)); at != int64(upTo) || epoch != want {
			t.Fatalf("committed %d with leader epoch %d, want %d with %d (the epoch of offset %d)", at, epoch, upTo, want, upTo-1)
		}
	}
}

// A group with nothing committed starts at the earliest record, franz-go's
// default; kgo.ConsumeResetOffset through WithClientOptions starts it at the
// end instead, and records produced before it joined are never handed out.
func TestNewGroupStartPosition(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 3, 3)
	if ds := receiveN(t, c.open(t, newGroup(), "orders"), 3); ds[0].Offset != 0 {
		t.Fatalf("a new group started at offset %d, want the earliest record (0)", ds[0].Offset)
	}
	s := c.open(t, newGroup(), "orders", WithClientOptions(kgo.ConsumeResetOffset(kgo.NewOffset().AtEnd())))
	var got []*adapters.Delivery
	eventually(t, "a record produced after joining", func() bool {
		// The end is resolved some time after the assignment: produce
		// until a record arrives, then check none came from before.
		c.produceN(t, "orders", 1, 1, 1)
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		ds, _ := s.Receive(ctx, 10)
		got = append(got, ds...)
		return len(got) > 0
	})
	for _, d := range got {
		if d.Offset < 3 {
			t.Fatalf("a group starting at the end handed out offset %d, produced before it joined", d.Offset)
		}
	}
}

// TestOptionBoundsAreAccepted: the smallest value each option documents as
// valid is accepted (an off-by-one in a check refuses a configuration the
// documentation promises).
func TestOptionBoundsAreAccepted(t *testing.T) {
	c := newCluster(t)
	required := []Option{WithBrokers(c.addrs...), WithGroup("g"), WithTopics("t")}
	for name, opts := range map[string][]Option{
		"WithCommitInterval(1ms)":                             {WithCommitInterval(time.Millisecond)},
		"WithCommitLinger(0)":                                 {WithCommitLinger(0)},
		"WithPollWait(1ms)":                                   {WithPollWait(time.Millisecond)},
		"WithRevokeDrain(0)":                                  {WithRevokeDrain(0)},
		"WithLagRefresh(0), the refresh off":                  {WithLagRefresh(0)},
		"WithMetadataLimit(32)":                               {WithMetadataLimit(32)},
		"WithMaxUnackedPerPartition equal to WithMaxUnacked":  {WithMaxUnacked(8), WithMaxUnackedPerPartition(8)},
		"WithMaxUnacked(1) and WithMaxUnackedPerPartition(1)": {WithMaxUnacked(1), WithMaxUnackedPerPartition(1)},
	} {
		s, err := New(context.Background(), append(slices.Clone(required), opts...)...)
		if err != nil {
			t.Errorf("%s: New = %v, want it accepted", name, err)
			continue
		}
		_ = s.Close()
	}
}

// A partition is paused as soon as its records handed out reach the bound,
// not one record later, and resumed below it.
func TestPartitionAtItsBoundIsPaused(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 3, 3)
	s := c.open(t, newGroup(), "orders", WithMaxUnackedPerPartition(3))
	ds := receiveN(t, s, 3)
	if paused := s.Client().PauseFetchPartitions(nil)["orders"]; !slices.Equal(paused, []int32{0}) {
		t.Fatalf("paused %v with 3 records of the bound of 3 handed out; want partition 0", paused)
	}
	ack(t, s, ds[0])
	if paused := s.Client().PauseFetchPartitions(nil); len(paused) != 0 {
		t.Fatalf("still paused %v below the bound", paused)
	}
}

// Done offsets inherited from a previous owner are passed on only as far as
// the metadata limit allows: the commit never carries more than the limit
// (a broker refuses such a commit outright, and would refuse it on every
// retry), and the first span that does not fit ends the list.
func TestInheritedDoneOffsetsBeyondTheMetadataLimitAreLeftOut(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 10, 10)
	group := newGroup()
	// A previous owner committed 0 with every even offset from 2 to 400
	// recorded done: far more than 64 bytes of metadata.
	var os kadm.Offsets
	os.Add(kadm.Offset{Topic: "orders", Partition: 0, At: 0, LeaderEpoch: -1,
		Metadata: encodeDone(0, func(fn func(int64, int32)) {
			for o := int64(2); o <= 400; o += 2 {
				fn(o, 0) // the epoch of kfake's records
			}
		})})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if resp, err := c.admin.CommitOffsets(ctx, group, os); err != nil || resp.Error() != nil {
		t.Fatalf("commit: %v %v", err, resp.Error())
	}
	const limit = 64
	s := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour), WithMetadataLimit(limit))
	ds := receiveN(t, s, 6) // 0 and the odd offsets to 9; the even ones are skipped
	for _, d := range ds {
		if d.Offset != 0 {
			ack(t, s, d)
		}
	}
	commitNow(t, s)
	offs, metas := c.committed(t, group, "orders")
	if offs[0] != 0 {
		t.Fatalf("committed %d, want 0 (offset 0 never finished)", offs[0])
	}
	if len(metas[0]) > limit {
		t.Fatalf("commit metadata of %d bytes, over the limit of %d: %q", len(metas[0]), limit, metas[0])
	}
	spans := decodeDone(metas[0], 0, -1)
	if len(spans) == 0 || spans[0] != (span{1, 10, 0}) {
		t.Fatalf("commit metadata records %v, want it to start with [1 10] (this owner's and the first inherited)", spans)
	}
}

// Nacked records come again once each, in offset order; an ack of a
// delivery already nacked, or acked, changes nothing: the nacked records
// stay not done, and the commit stops before them. The ack of a nacked one
// fails its entry, since the record comes back.
func TestAckAfterNackFailsAndTwiceIsIgnored(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 3, 3)
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	ds := receiveN(t, s, 3)
	if err := s.Nack(context.Background(), adapters.NackAll(ds[:2], 0)); err != nil {
		t.Fatal(err)
	}
	// Late: the record was given back, and comes back whatever the Ack
	// says, so the Ack must not report it settled.
	if err := s.Ack(context.Background(), ds[:1]); adapters.EntryError(err, 0) == nil {
		t.Fatalf("Ack of a nacked record returned %v, want its entry failed", err)
	}
	ack(t, s, ds[2])
	ack(t, s, ds[2]) // twice
	commitNow(t, s)
	if offs, _ := c.committed(t, group, "orders"); offs[0] != 0 {
		t.Fatalf("committed %d although offset 0 was nacked before its ack", offs[0])
	}
	again := receiveN(t, s, 2)
	if got := offsets(again); !slices.Equal(got, []int64{0, 1}) {
		t.Fatalf("redelivered offsets %v, want [0 1]", got)
	}
	if more := receiveFor(t, s, 300*time.Millisecond); len(more) > 0 {
		t.Fatalf("handed out %v more after the redelivery", offsets(more))
	}
	ack(t, s, again...)
	commitNow(t, s)
	if offs, _ := c.committed(t, group, "orders"); offs[0] != 3 {
		t.Fatalf("committed %d, want 3", offs[0])
	}
}

// A nacked record comes back as a delivery of its own: the runtime's
// losing the nacked one (its handler's context cancelled late), or a late
// Ack of it, reaches neither the redelivery nor the record's commit.
func TestRedeliveryIsANewDelivery(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 1, 1)
	group := newGroup()
	s := c.open(t, group, "orders", WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	first := receiveN(t, s, 1)[0]
	if err := s.Nack(context.Background(), adapters.NackAll([]*adapters.Delivery{first}, 0)); err != nil {
		t.Fatal(err)
	}
	again := receiveN(t, s, 1)[0]
	if again == first || again.Signal == first.Signal || again.Handle == first.Handle {
		t.Fatal("the redelivery shares the nacked delivery, its Signal or its Handle")
	}
	if again.ID != first.ID || again.Offset != 0 || string(again.Body) != string(first.Body) {
		t.Fatalf("the redelivery is %s at %d, want the record of %s", again.ID, again.Offset, first.ID)
	}
	first.Signal.Lose(errors.New("lost late"))
	if err := again.Signal.LostCause(); err != nil {
		t.Fatalf("losing the nacked delivery lost the redelivery: %v", err)
	}
	if err := s.Ack(context.Background(), []*adapters.Delivery{first}); adapters.EntryError(err, 0) == nil {
		t.Fatalf("Ack of the nacked delivery after its redelivery returned %v, want its entry failed", err)
	}
	commitNow(t, s)
	if offs, _ := c.committed(t, group, "orders"); offs[0] != 0 {
		t.Fatalf("committed %d: the nacked delivery's Ack settled its redelivery", offs[0])
	}
	ack(t, s, again)
	commitNow(t, s)
	if offs, _ := c.committed(t, group, "orders"); offs[0] != 1 {
		t.Fatalf("committed %d, want 1", offs[0])
	}
}

// One Receive shares its records out over the partitions with records
// waiting, so that a runtime asking for few still gets work for every
// partition's lane, not a batch of one partition's.
func TestReceiveSharesOutOverThePartitions(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 4)
	c.produceN(t, "orders", 4, 10, 10)
	s := c.open(t, newGroup(), "orders", WithOrderingScope(Unordered))
	// Wait until every partition has records polled and waiting, taking
	// one record at a time meanwhile.
	var held []*adapters.Delivery
	eventually(t, "records of every partition waiting", func() bool {
		s.mu.Lock()
		waiting := 0
		for _, p := range s.order {
			if p.backlogLen() > 0 {
				waiting++
			}
		}
		s.mu.Unlock()
		if waiting == 4 {
			return true
		}
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		ds, _ := s.Receive(ctx, 1)
		held = append(held, ds...)
		return false
	})
	ds, err := s.Receive(context.Background(), 4)
	if err != nil {
		t.Fatal(err)
	}
	parts := map[int32]bool{}
	for _, d := range ds {
		parts[d.Partition] = true
	}
	if len(ds) != 4 || len(parts) != 4 {
		t.Fatalf("Receive(4) handed out %d records of partitions %v; want one of each of the 4", len(ds), parts)
	}
}

// A deep backlog in every partition: a poll takes records partition by
// partition, each as far as the client has it, so a poll of a number of
// records would give the first partitions all of it, and the runtime would
// get records of those partitions only (one worker busy per partition
// covered, by partition) until they were all done. The Source takes all the
// client fetched, and the first Receive hands out records of every
// partition; the partitions it holds enough of are paused.
func TestDeepBacklogIsSharedOverThePartitions(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 8)
	c.produceN(t, "orders", 8, 1000, 10)
	s := c.open(t, newGroup(), "orders")
	ds := receiveN(t, s, 16)
	per := map[int32]int{}
	for _, d := range ds {
		per[d.Partition]++
	}
	if len(per) != 8 {
		t.Fatalf("the first 16 records handed out came from partitions %v; want records of all 8", per)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.order {
		if p.backlogLen()+p.nheld >= s.cfg.maxPerPart && !p.paused {
			t.Errorf("partition %d holds %d records, at least its bound of %d, and is not paused", p.id, p.backlogLen()+p.nheld, s.cfg.maxPerPart)
		}
	}
}

// Many records of a partition finishing out of order, with two early ones
// still running, keep track of those two: their acks mark them done, and
// the commit reaches the end.
func TestOutOfOrderAcksAroundLongRunningRecords(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 120, 120)
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	ds := receiveN(t, s, 100)
	var slow []*adapters.Delivery
	for _, d := range ds {
		if d.Offset == 1 || d.Offset == 50 {
			slow = append(slow, d)
			continue
		}
		ack(t, s, d)
	}
	rest := receiveN(t, s, 20) // handed out beside the two still running
	ack(t, s, slow[1], slow[0])
	ack(t, s, rest...)
	commitNow(t, s)
	if offs, _ := c.committed(t, group, "orders"); offs[0] != 120 {
		t.Fatalf("committed %d with every record done, want 120", offs[0])
	}
}
