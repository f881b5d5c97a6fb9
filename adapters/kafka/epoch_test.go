package kafka

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// newEpoch starts a new leader epoch for topic/0 (a leader election: kfake
// keeps the records, and those produced from now on carry the new epoch).
func (c *cluster) newEpoch(t testing.TB, topic string) {
	t.Helper()
	if err := c.fake.MoveTopicPartition(topic, 0, c.fake.LeaderFor(topic, 0)); err != nil {
		t.Fatal(err)
	}
}

// commitAs commits offset at epoch with meta for group on topic/0, as a
// previous owner would have.
func (c *cluster) commitAs(t testing.TB, group, topic string, at int64, epoch int32, meta string) {
	t.Helper()
	var os kadm.Offsets
	os.Add(kadm.Offset{Topic: topic, Partition: 0, At: at, LeaderEpoch: epoch, Metadata: meta})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if resp, err := c.admin.CommitOffsets(ctx, group, os); err != nil || resp.Error() != nil {
		t.Fatalf("commit: %v %v", err, resp.Error())
	}
}

// The commit metadata names done records by offset and leader epoch. After
// an unclean leader election rewrites the log above the committed offset,
// the records now at the offsets a previous owner recorded done are of a
// newer epoch: they are other records, and the next owner runs them all. The
// metadata of the previous version, which records no epochs, is read with
// the epoch of its commit.
func TestDoneOffsetsOfAnOlderLeaderEpochAreNotSkipped(t *testing.T) {
	done105to110 := func(epoch int32) string {
		return encodeDone(100, done(span{105, 110, epoch}))
	}
	for _, tc := range []struct {
		name string
		meta string
		want []int64 // handed out of 100..119
	}{
		{"recorded under epoch 1", done105to110(1), seq(100, 119)},
		{"recorded under epoch 1 by the previous version", legacyMetadata(100, span{from: 105, to: 110}), seq(100, 119)},
		// The control: the same spans recorded under the records' epoch
		// are skipped.
		{"recorded under epoch 2", done105to110(2), append(seq(100, 104), seq(111, 119)...)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t)
			const topic = "rewritten"
			c.createTopic(t, topic, 1)
			c.newEpoch(t, topic)            // epoch 1
			produceValues(t, c, topic, 100) // 0..99 under epoch 1
			c.newEpoch(t, topic)            // epoch 2: the log from 100 on is rewritten
			produceValues(t, c, topic, 20)  // 100..119 under epoch 2
			group := newGroup()
			c.commitAs(t, group, topic, 100, 1, tc.meta)

			s := c.open(t, group, topic, WithOrderingScope(Unordered), WithCommitInterval(time.Hour))
			got := receiveThrough(t, s, 119)
			if o := offsets(got); !slices.Equal(o, tc.want) {
				t.Fatalf("handed out %v, want %v", o, tc.want)
			}
			for _, d := range got {
				var r *kgo.Record
				if r = d.Native.(*kgo.Record); r.LeaderEpoch != 2 {
					t.Fatalf("offset %d has leader epoch %d, want 2: the test does not set up what it means to", d.Offset, r.LeaderEpoch)
				}
			}
			ack(t, s, got...)
			commitNow(t, s)
			if offs, _ := c.committed(t, group, topic); offs[0] != 120 {
				t.Errorf("committed %d with every record done, want 120", offs[0])
			}
		})
	}
}

// receiveThrough receives until the record at offset last is handed out (or
// fails the test after a generous deadline), and returns all it received.
func receiveThrough(t testing.TB, s *Source, last int64) []*adapters.Delivery {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out []*adapters.Delivery
	for len(out) == 0 || out[len(out)-1].Offset < last {
		ds, err := s.Receive(ctx, 100)
		if err != nil {
			t.Fatalf("receive, with offsets %v handed out: %v", offsets(out), err)
		}
		out = append(out, ds...)
	}
	return out
}
