package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.opentelemetry.io/otel/metric/noop"
)

// loseData makes the cluster tell the consumers of topic/0 that the log
// diverged at divergedAt, as a new leader does after an unclean election:
// the next fetch of the partition is fenced, and the leader-epoch check that
// follows answers that the log ends at divergedAt. franz-go then reports a
// kgo.ErrDataLoss and resumes fetching there. (kfake keeps the records, so
// the records "replacing" the lost ones have the same contents.)
func (c *cluster) loseData(t testing.TB, topic string, divergedAt int64) {
	t.Helper()
	var fenced, answered atomic.Bool
	c.fake.ControlKey(int16(kmsg.Fetch), func(req kmsg.Request) (kmsg.Response, error, bool) {
		if fenced.Load() {
			return nil, nil, false
		}
		r := req.(*kmsg.FetchRequest)
		resp := r.ResponseKind().(*kmsg.FetchResponse)
		for _, rt := range r.Topics {
			if rt.Topic != topic && rt.TopicID != c.topicID(t, topic) {
				continue
			}
			st := kmsg.NewFetchResponseTopic()
			st.Topic, st.TopicID = rt.Topic, rt.TopicID
			for _, rp := range rt.Partitions {
				sp := kmsg.NewFetchResponseTopicPartition()
				sp.Partition = rp.Partition
				if rp.Partition == 0 {
					sp.ErrorCode = kerr.FencedLeaderEpoch.Code
				}
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		if len(resp.Topics) == 0 {
			return nil, nil, false // another topic's fetch: let the cluster answer
		}
		fenced.Store(true)
		return resp, nil, true
	})
	c.fake.ControlKey(int16(kmsg.OffsetForLeaderEpoch), func(req kmsg.Request) (kmsg.Response, error, bool) {
		if answered.Load() {
			return nil, nil, false
		}
		r := req.(*kmsg.OffsetForLeaderEpochRequest)
		resp := r.ResponseKind().(*kmsg.OffsetForLeaderEpochResponse)
		for _, rt := range r.Topics {
			st := kmsg.NewOffsetForLeaderEpochResponseTopic()
			st.Topic = rt.Topic
			for _, rp := range rt.Partitions {
				sp := kmsg.NewOffsetForLeaderEpochResponseTopicPartition()
				sp.Partition, sp.LeaderEpoch, sp.EndOffset = rp.Partition, rp.LeaderEpoch, divergedAt
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		answered.Store(true)
		return resp, nil, true
	})
}

func (c *cluster) topicID(t testing.TB, topic string) [16]byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	td, err := c.admin.ListTopics(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	return td[topic].ID
}

// receiveThroughLoss receives n deliveries, or what arrives in a generous
// time, and returns them with the last error other than a poll's timeout.
func receiveThroughLoss(t testing.TB, s *Source, n int) ([]*adapters.Delivery, error) {
	t.Helper()
	var out []*adapters.Delivery
	var last error
	for deadline := time.Now().Add(20 * time.Second); len(out) < n && time.Now().Before(deadline); {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		ds, err := s.Receive(ctx, n-len(out))
		cancel()
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			last = err
		}
		out = append(out, ds...)
	}
	return out, last
}

func produceValues(t testing.TB, c *cluster, topic string, n int) {
	t.Helper()
	rs := make([]*kgo.Record, n)
	for i := range rs {
		rs[i] = &kgo.Record{Topic: topic, Value: []byte(fmt.Sprintf("v%d", i))}
	}
	c.produce(t, rs...)
}

// TestDataLossRewindHandsOutTheReplacedRecords: when the broker loses
// records the consumer already polled and the client rewinds the partition,
// the records the log now holds at those offsets are handed out (the old
// filter of polled offsets dropped them, and the commit then went past them
// unseen); records polled but not done below the rewind point are fetched
// again rather than committed past; the old records in flight lose their
// context with ErrRewound, and their late acks are refused.
func TestDataLossRewindHandsOutTheReplacedRecords(t *testing.T) {
	c := newCluster(t)
	const topic = "rewind"
	c.createTopic(t, topic, 1)
	produceValues(t, c, topic, 30)
	group := newGroup()
	s := c.open(t, group, topic, WithClientOptions(kgo.DisableFetchSessions(), kgo.FetchMaxWait(100*time.Millisecond)))

	first := receiveN(t, s, 30)
	ack(t, s, first[:10]...) // 0..9 done; 10..29 still running
	commitNow(t, s)

	c.loseData(t, topic, 15) // 15 and beyond replaced
	again, sawLoss := receiveThroughLoss(t, s, 20)
	want := make([]int64, 20)
	for i := range want {
		want[i] = int64(10 + i)
	}
	if got := offsets(again); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after the rewind, handed out offsets %v; want 10..29 once each (10..14 were not done, 15..29 replaced)", got)
	}
	var loss *kgo.ErrDataLoss
	if !errors.As(sawLoss, &loss) {
		t.Errorf("Receive reported %v; want the kgo.ErrDataLoss", sawLoss)
	}
	for _, d := range first[10:] {
		if !errors.Is(d.Signal.LostCause(), ErrRewound) {
			t.Fatalf("offset %d of the old log: lost with %v after the rewind; want ErrRewound", d.Offset, d.Signal.LostCause())
		}
	}
	if err := s.Ack(context.Background(), first[10:]); !errors.Is(adapters.EntryError(err, 0), adapters.ErrRevoked) {
		t.Errorf("acking an old record after the rewind: %v; want ErrRevoked", err)
	}
	commitNow(t, s)
	if offs, _ := c.committed(t, group, topic); offs[0] != 10 {
		t.Errorf("committed %d after the rewind with nothing new done; want 10 (old acks must not count)", offs[0])
	}
	ack(t, s, again...)
	commitNow(t, s)
	if offs, _ := c.committed(t, group, topic); offs[0] != 30 {
		t.Errorf("committed %d after everything was done; want 30", offs[0])
	}
}

// TestDataLossRewindCommitsBackToTheReplacedRecords: when every record below
// the rewind point is done and some beyond it were committed, the new
// assignment epoch commits the rewind point at once (without waiting for the
// commit interval), below the old commit,
// so a consumer starting after a crash does not skip the records that
// replaced the lost ones.
func TestDataLossRewindCommitsBackToTheReplacedRecords(t *testing.T) {
	c := newCluster(t)
	const topic = "rewind-commit"
	c.createTopic(t, topic, 1)
	produceValues(t, c, topic, 30)
	group := newGroup()
	s := c.open(t, group, topic, WithCommitInterval(time.Hour), WithCommitLinger(time.Hour),
		WithClientOptions(kgo.DisableFetchSessions(), kgo.FetchMaxWait(100*time.Millisecond)))
	ack(t, s, receiveN(t, s, 30)...)
	commitNow(t, s)
	if offs, _ := c.committed(t, group, topic); offs[0] != 30 {
		t.Fatalf("committed %d; want 30", offs[0])
	}

	c.loseData(t, topic, 20)
	again, _ := receiveThroughLoss(t, s, 10)
	if len(again) != 10 || offsets(again)[0] != 20 || offsets(again)[9] != 29 {
		t.Fatalf("after the rewind, handed out %v; want 20..29", offsets(again))
	}
	// Committed at once, not at the (hour-long) interval: until then a
	// crash would skip the replaced records.
	eventually(t, "the rewind point committed", func() bool {
		offs, _ := c.committed(t, group, topic)
		return offs[0] == 20
	})
	ack(t, s, again...)
	commitNow(t, s)
	if offs, _ := c.committed(t, group, topic); offs[0] != 30 {
		t.Errorf("committed %d after the replaced records were done; want 30", offs[0])
	}
}

// TestDataLossRewindWithReplacedRecordsAlreadyBuffered: franz-go fetches
// from the rewind point as soon as it rewinds, and appends its data-loss
// notice after the fetched records of a poll. When the Source polls late
// (the runtime busy, the unacked bound reached), one poll holds the records
// that replaced the lost ones and then the notice. The records must be
// handed out: taken for old records already polled, they were dropped, never
// fetched again, and the commit went past them once later records were done.
func TestDataLossRewindWithReplacedRecordsAlreadyBuffered(t *testing.T) {
	c := newCluster(t)
	const topic = "rewind-buffered"
	c.createTopic(t, topic, 1)
	produceValues(t, c, topic, 30)
	group := newGroup()
	s := c.open(t, group, topic, WithCommitInterval(time.Hour), WithCommitLinger(time.Hour),
		WithClientOptions(kgo.DisableFetchSessions(), kgo.FetchMaxWait(100*time.Millisecond)))
	ack(t, s, receiveN(t, s, 30)...)
	commitNow(t, s)

	c.loseData(t, topic, 20)
	// No Receive meanwhile: the client rewinds and buffers 20..29 again.
	eventually(t, "the replaced records buffered", func() bool { return s.Client().BufferedFetchRecords() >= 10 })
	produceValues(t, c, topic, 5) // 30..34, after the replaced records

	got, sawLoss := receiveThroughLoss(t, s, 15)
	var loss *kgo.ErrDataLoss
	if !errors.As(sawLoss, &loss) {
		t.Errorf("Receive reported %v; want the kgo.ErrDataLoss", sawLoss)
	}
	want := make([]int64, 15)
	for i := range want {
		want[i] = int64(20 + i)
	}
	if fmt.Sprint(offsets(got)) != fmt.Sprint(want) {
		t.Fatalf("after the rewind, handed out offsets %v; want 20..34 once each (20..29 replaced the lost records)", offsets(got))
	}
	ack(t, s, got[10:]...) // 30..34 done, the replaced records still running
	commitNow(t, s)
	if offs, _ := c.committed(t, group, topic); offs[0] != 20 {
		t.Errorf("committed %d with the replaced records 20..29 not done; want 20", offs[0])
	}
}

// TestDataLossNoticeAfterTheRecordsOfItsPoll: franz-go appends a data-loss
// notice after the records of the poll it comes with. Here the client could
// not locate the loss and resumed where it was (ResetTo is the next offset
// to read), and the same poll already holds the records read from there.
// Those records are new: taken first, they moved the partition past the
// reset point, the notice then looked like a rewind below them, and they
// were dropped with nothing left to fetch them again.
func TestDataLossNoticeAfterTheRecordsOfItsPoll(t *testing.T) {
	cfg := defaultConfig()
	tel, err := newTelemetry(noop.NewMeterProvider(), "g", nil)
	if err != nil {
		t.Fatal(err)
	}
	s := &Source{cfg: cfg, tel: tel, parts: map[tpKey]*partition{}}
	s.parts[tpKey{"t", 0}] = newPartition("t", 0, 1)
	s.rebuildOrderLocked()
	records := func(offs ...int64) []*kgo.Record {
		var rs []*kgo.Record
		for _, o := range offs {
			rs = append(rs, &kgo.Record{Topic: "t", Partition: 0, Offset: o, Value: []byte("v")})
		}
		return rs
	}
	s.registerLocked(kgo.Fetches{{Topics: []kgo.FetchTopic{{Topic: "t", Partitions: []kgo.FetchPartition{{Partition: 0, HighWatermark: 3, Records: records(0, 1, 2)}}}}}})
	first := s.takeLocked(nil, 100)
	if err := s.Ack(context.Background(), first); err != nil {
		t.Fatal(err)
	}
	loss := &kgo.ErrDataLoss{Topic: "t", Partition: 0, ConsumedTo: 3, ResetTo: 3}
	refetch, lose, _ := s.registerLocked(kgo.Fetches{
		{Topics: []kgo.FetchTopic{{Topic: "t", Partitions: []kgo.FetchPartition{{Partition: 0, HighWatermark: 5, Records: records(3, 4)}}}}},
		{Topics: []kgo.FetchTopic{{Topic: "t", Partitions: []kgo.FetchPartition{{Partition: 0, Err: loss}}}}},
	})
	second := s.takeLocked(nil, 100)
	if fmt.Sprint(offsets(second)) != "[3 4]" || len(refetch) != 0 || len(lose) != 0 {
		t.Fatalf("handed out %v (refetch %v, %d lost) after a poll of 3, 4 and a notice of a loss at 3; want 3 and 4, nothing refetched or lost", offsets(second), refetch, len(lose))
	}
	if p := s.parts[tpKey{"t", 0}]; p.hwm != 5 {
		t.Errorf("high watermark %d after the notice; want 5 (the notice has none)", p.hwm)
	}
}

// TestDataLossPollMixingOldAndNewLogIsFetchedAgain: a late poll can hold
// records of the old log fetched before the loss was detected (30..34,
// beyond what was polled), the new log's records from the rewind point
// (20..29), and the notice. Booked in poll order, the old log's 30..34 were
// handed out and the new log's 20..29 then dropped as already polled; the
// partition is fetched again from the rewind point instead.
func TestDataLossPollMixingOldAndNewLogIsFetchedAgain(t *testing.T) {
	tel, err := newTelemetry(noop.NewMeterProvider(), "g", nil)
	if err != nil {
		t.Fatal(err)
	}
	s := &Source{cfg: defaultConfig(), tel: tel, parts: map[tpKey]*partition{}}
	s.parts[tpKey{"t", 0}] = newPartition("t", 0, 1)
	s.rebuildOrderLocked()
	records := func(from, to int64) []*kgo.Record {
		var rs []*kgo.Record
		for o := from; o <= to; o++ {
			rs = append(rs, &kgo.Record{Topic: "t", Partition: 0, Offset: o, Value: []byte("v")})
		}
		return rs
	}
	part := func(fp kgo.FetchPartition) kgo.Fetch {
		return kgo.Fetch{Topics: []kgo.FetchTopic{{Topic: "t", Partitions: []kgo.FetchPartition{fp}}}}
	}
	s.registerLocked(kgo.Fetches{part(kgo.FetchPartition{Partition: 0, HighWatermark: 30, Records: records(0, 29)})})
	if err := s.Ack(context.Background(), s.takeLocked(nil, 100)); err != nil {
		t.Fatal(err)
	}
	loss := &kgo.ErrDataLoss{Topic: "t", Partition: 0, ConsumedTo: 35, ResetTo: 20}
	refetch, _, _ := s.registerLocked(kgo.Fetches{
		part(kgo.FetchPartition{Partition: 0, HighWatermark: 35, Records: records(30, 34)}), // the old log
		part(kgo.FetchPartition{Partition: 0, HighWatermark: 30, Records: records(20, 29)}), // the new log
		part(kgo.FetchPartition{Partition: 0, Err: loss}),
	})
	if got := s.takeLocked(nil, 100); len(got) != 0 {
		t.Errorf("handed out %v from a poll mixing two logs; want nothing, the partition fetched again", offsets(got))
	}
	if eo, ok := refetch["t"][0]; !ok || eo.Offset != 20 {
		t.Fatalf("refetch %v; want partition 0 fetched again from 20", refetch)
	}
}

// TestDataLossAtTheLastPolledOffsetRewinds: a loss whose reset point is the
// last offset polled (the log now ends before it) replaced that record: the
// one the log then holds at that offset is handed out, not dropped as
// already polled.
func TestDataLossAtTheLastPolledOffsetRewinds(t *testing.T) {
	tel, err := newTelemetry(noop.NewMeterProvider(), "g", nil)
	if err != nil {
		t.Fatal(err)
	}
	s := &Source{cfg: defaultConfig(), tel: tel, parts: map[tpKey]*partition{}}
	s.parts[tpKey{"t", 0}] = newPartition("t", 0, 1)
	s.rebuildOrderLocked()
	rec := func(o int64, v string) *kgo.Record {
		return &kgo.Record{Topic: "t", Partition: 0, Offset: o, Value: []byte(v)}
	}
	part := func(fp kgo.FetchPartition) kgo.Fetches {
		return kgo.Fetches{{Topics: []kgo.FetchTopic{{Topic: "t", Partitions: []kgo.FetchPartition{fp}}}}}
	}
	s.registerLocked(part(kgo.FetchPartition{Partition: 0, HighWatermark: 3, Records: []*kgo.Record{rec(0, "a"), rec(1, "b"), rec(2, "old")}}))
	if err := s.Ack(context.Background(), s.takeLocked(nil, 100)); err != nil {
		t.Fatal(err)
	}
	loss := &kgo.ErrDataLoss{Topic: "t", Partition: 0, ConsumedTo: 3, ResetTo: 2}
	s.registerLocked(part(kgo.FetchPartition{Partition: 0, Err: loss}))
	s.registerLocked(part(kgo.FetchPartition{Partition: 0, HighWatermark: 3, Records: []*kgo.Record{rec(2, "new")}}))
	got := s.takeLocked(nil, 100)
	if len(got) != 1 || got[0].Offset != 2 || string(got[0].Body) != "new" {
		t.Fatalf("after a loss resetting to 2, the last offset polled, handed out %v; want the record now at 2", offsets(got))
	}
}

// TestDataLossRewindResumesAPausedPartition: a partition paused at its
// unacked bound when its records are lost is fetched again after the
// rewind: the old records no longer count against the bound, and paused it
// would never fetch the records that replaced them.
func TestDataLossRewindResumesAPausedPartition(t *testing.T) {
	tel, err := newTelemetry(noop.NewMeterProvider(), "g", nil)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers("127.0.0.1:1"))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	cfg := defaultConfig()
	cfg.maxPerPart = 3
	s := &Source{cfg: cfg, tel: tel, cl: cl, parts: map[tpKey]*partition{}}
	s.parts[tpKey{"t", 0}] = newPartition("t", 0, 1)
	s.rebuildOrderLocked()
	var rs []*kgo.Record
	for o := int64(0); o < 5; o++ {
		rs = append(rs, &kgo.Record{Topic: "t", Partition: 0, Offset: o, Value: []byte("v")})
	}
	part := func(fp kgo.FetchPartition) kgo.Fetches {
		return kgo.Fetches{{Topics: []kgo.FetchTopic{{Topic: "t", Partitions: []kgo.FetchPartition{fp}}}}}
	}
	s.registerLocked(part(kgo.FetchPartition{Partition: 0, HighWatermark: 5, Records: rs}))
	if held := s.takeLocked(nil, 100); len(held) != 3 {
		t.Fatalf("took %d records; want 3, the partition's bound", len(held))
	}
	if paused := cl.PauseFetchPartitions(nil); len(paused["t"]) != 1 {
		t.Fatalf("paused %v at the bound; want t/0 paused", paused)
	}
	loss := &kgo.ErrDataLoss{Topic: "t", Partition: 0, ConsumedTo: 5, ResetTo: 3}
	refetch, _, _ := s.registerLocked(part(kgo.FetchPartition{Partition: 0, Err: loss}))
	if eo, ok := refetch["t"][0]; !ok || eo.Offset != 0 {
		t.Fatalf("refetch %v; want t/0 fetched again from 0 (nothing done)", refetch)
	}
	if paused := cl.PauseFetchPartitions(nil); len(paused) != 0 {
		t.Fatalf("still paused after the rewind: %v; the partition would never be fetched again", paused)
	}
}

// TestDataLossRewindForgetsDoneOffsetsBeyondTheResetPoint: a previous owner
// recorded offsets done in its commit metadata; the broker then lost the log
// from below them, and new records took their offsets. The metadata named
// the lost records: after the rewind, the records now at those offsets must
// be handed out, not skipped as done and committed past.
func TestDataLossRewindForgetsDoneOffsetsBeyondTheResetPoint(t *testing.T) {
	c := newCluster(t)
	const topic = "rewind-skip"
	c.createTopic(t, topic, 1)
	produceValues(t, c, topic, 5) // 0..4
	group := newGroup()
	// A previous owner committed 0, with 5..9 (records of the old log)
	// recorded done.
	var os kadm.Offsets
	os.Add(kadm.Offset{Topic: topic, Partition: 0, At: 0, LeaderEpoch: -1,
		Metadata: encodeDone(0, func(fn func(int64, int32)) {
			for o := int64(5); o <= 9; o++ {
				fn(o, 0) // the epoch of kfake's records
			}
		})})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if resp, err := c.admin.CommitOffsets(ctx, group, os); err != nil || resp.Error() != nil {
		t.Fatalf("commit: %v %v", err, resp.Error())
	}
	s := c.open(t, group, topic, WithCommitInterval(time.Hour), WithCommitLinger(time.Hour), WithOrderingScope(Unordered),
		WithClientOptions(kgo.DisableFetchSessions(), kgo.FetchMaxWait(100*time.Millisecond)))
	first := receiveN(t, s, 5)
	ack(t, s, first[:2]...) // 0..1 done, 2..4 running

	c.loseData(t, topic, 3)       // 3 and beyond replaced
	produceValues(t, c, topic, 5) // 5..9, written after the loss
	again, _ := receiveThroughLoss(t, s, 8)
	if got := offsets(again); !slices.Equal(got, []int64{2, 3, 4, 5, 6, 7, 8, 9}) {
		t.Fatalf("after the rewind, handed out offsets %v; want 2..9 (2 not done, 3..9 the new log's)", got)
	}
	ack(t, s, again...)
	commitNow(t, s)
	if offs, _ := c.committed(t, group, topic); offs[0] != 10 {
		t.Errorf("committed %d after everything was done; want 10", offs[0])
	}
}
