package kafka

import (
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"
)

// TestRefetchedRecordsAreNotHandedOutTwice: when the client returns records
// the Source already polled (a refetch after a pause, a retried fetch), none
// of them, including the last one polled, is handed out a second time: it
// would run twice and leave the partition's books out of step.
func TestRefetchedRecordsAreNotHandedOutTwice(t *testing.T) {
	s := &Source{cfg: defaultConfig(), parts: map[tpKey]*partition{}}
	p := newPartition("t", 0, 1)
	s.parts[tpKey{"t", 0}] = p
	s.rebuildOrderLocked()
	fetch := func(offs ...int64) kgo.Fetches {
		var rs []*kgo.Record
		for _, o := range offs {
			rs = append(rs, &kgo.Record{Topic: "t", Partition: 0, Offset: o, Value: []byte("v")})
		}
		return kgo.Fetches{{Topics: []kgo.FetchTopic{{Topic: "t", Partitions: []kgo.FetchPartition{{Partition: 0, HighWatermark: 10, Records: rs}}}}}}
	}
	s.registerLocked(fetch(0, 1, 2))
	first := s.takeLocked(nil, 100)
	s.registerLocked(fetch(2, 3)) // 2 again
	second := s.takeLocked(nil, 100)
	seen := map[int64]int{}
	for _, d := range append(first, second...) {
		seen[d.Offset]++
	}
	for off, n := range seen {
		if n != 1 {
			t.Errorf("offset %d handed out %d times", off, n)
		}
	}
	if len(seen) != 4 {
		t.Fatalf("handed out offsets %v, want 0..3 once each", seen)
	}
}
