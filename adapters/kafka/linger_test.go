package kafka

import (
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// Acked records reach the broker's committed offset a linger after the ack,
// not at the commit interval (here an hour): a crash then repeats only what
// was done since.
func TestAckedRecordsAreCommittedWithoutWaitingForTheInterval(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 2)
	c.produceN(t, "orders", 2, 10, 10)
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour))
	ds := receiveN(t, s, 20)
	ack(t, s, ds...)
	eventually(t, "both partitions committed at 10 (the hang guard; the linger is 5ms)", func() bool {
		offs, _ := c.committed(t, group, "orders")
		return offs[0] == 10 && offs[1] == 10
	})
}

// One commit request is in flight at a time, and the records marked done
// while it is, on any partition, all go in the next one: a commit held at
// the broker while three other partitions advance is followed by one
// request carrying the three.
func TestCommitsAreOneAtATimeAndCoalesceThePartitions(t *testing.T) {
	const parts = 4
	c := newCluster(t)
	c.createTopic(t, "orders", parts)
	c.produceN(t, "orders", parts, 1, 1)
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour))
	byPart := map[int32][]int64{}
	ds := receiveN(t, s, parts)
	for _, d := range ds {
		byPart[d.Partition] = append(byPart[d.Partition], d.Offset)
	}
	if len(byPart) != parts {
		t.Fatalf("received %v, want one record of each of the %d partitions", byPart, parts)
	}

	var (
		mu       sync.Mutex
		requests [][]int32 // partitions of each commit request, in arrival order
		inFlight int
		maxIn    int
	)
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	c.fake.ControlKey(int16(kmsg.OffsetCommit), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.fake.KeepControl()
		r := req.(*kmsg.OffsetCommitRequest)
		if r.Group != group {
			return nil, nil, false
		}
		var ps []int32
		for _, rt := range r.Topics {
			for _, rp := range rt.Partitions {
				ps = append(ps, rp.Partition)
			}
		}
		slices.Sort(ps)
		mu.Lock()
		requests = append(requests, ps)
		inFlight++
		maxIn = max(maxIn, inFlight)
		first := len(requests) == 1
		mu.Unlock()
		if first {
			once.Do(func() { close(held) })
			c.fake.SleepControl(func() { <-release })
		}
		mu.Lock()
		inFlight--
		mu.Unlock()
		return nil, nil, false
	})

	var first int32 = -1
	for _, d := range ds {
		if first < 0 {
			first = d.Partition
			ack(t, s, d)
			await(t, "the first commit to reach the broker", held)
			continue
		}
		ack(t, s, d)
	}
	close(release)
	eventually(t, "every partition committed", func() bool {
		offs, _ := c.committed(t, group, "orders")
		for p := int32(0); p < parts; p++ {
			if offs[p] != 1 {
				return false
			}
		}
		return true
	})
	mu.Lock()
	defer mu.Unlock()
	var rest []int32
	for p := int32(0); p < parts; p++ {
		if p != first {
			rest = append(rest, p)
		}
	}
	if len(requests) != 2 || !slices.Equal(requests[0], []int32{first}) || !slices.Equal(requests[1], rest) {
		t.Errorf("commit requests carried partitions %v; want [[%d] %v]: the first, then one with the others", requests, first, rest)
	}
	if maxIn != 1 {
		t.Errorf("%d commit requests were at the broker at once; want 1", maxIn)
	}
}

func TestCommitLingerBounds(t *testing.T) {
	for _, tc := range []struct {
		opts []Option
		want time.Duration
	}{
		{nil, DefaultCommitLinger},
		{[]Option{WithCommitInterval(2 * time.Millisecond)}, 2 * time.Millisecond},
		{[]Option{WithCommitLinger(0)}, 0},
		{[]Option{WithCommitLinger(time.Second)}, time.Second},
	} {
		cfg := defaultConfig()
		for _, o := range append([]Option{WithBrokers("b:9092"), WithGroup("g"), WithTopics("t")}, tc.opts...) {
			if err := o(&cfg); err != nil {
				t.Fatal(err)
			}
		}
		if err := cfg.validate(); err != nil {
			t.Fatal(err)
		}
		if cfg.commitLinger != tc.want {
			t.Errorf("linger %v, want %v", cfg.commitLinger, tc.want)
		}
	}
}

// A coordinator that refuses commits gets one a commit interval, not one per
// linger: after a failed commit, acks wait for the next tick (here an hour
// away). The acks below come a few lingers apart; each committed at once,
// they made a request each.
func TestRefusedCommitIsNotRetriedPerAck(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 10, 10)
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour))
	ds := receiveN(t, s, 10)
	var requests atomic.Int64
	c.fake.ControlKey(int16(kmsg.OffsetCommit), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.fake.KeepControl()
		requests.Add(1)
		return offsetCommitResponse(kreq.(*kmsg.OffsetCommitRequest), kerr.GroupAuthorizationFailed.Code), nil, true
	})
	ack(t, s, ds[0])
	eventually(t, "the first commit to be refused", func() bool { return requests.Load() == 1 })
	for _, d := range ds[1:] {
		ack(t, s, d)
		time.Sleep(4 * DefaultCommitLinger)
	}
	if n := requests.Load(); n != 1 {
		t.Fatalf("%d commit requests after the first was refused and 9 more acks; want only the first until the next tick", n)
	}
}
