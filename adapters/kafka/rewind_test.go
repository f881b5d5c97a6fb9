package kafka

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
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
		if !errors.Is(d.LostCause(), ErrRewound) {
			t.Fatalf("offset %d of the old log: lost with %v after the rewind; want ErrRewound", d.Offset, d.LostCause())
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
	s := c.open(t, group, topic, WithCommitInterval(time.Hour),
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
