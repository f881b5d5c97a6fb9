package kafka

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/consumer"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// newMeter returns a meter provider whose metrics the reader collects, shut
// down with the test.
func newMeter(t *testing.T) (*sdkmetric.ManualReader, *sdkmetric.MeterProvider) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { mp.Shutdown(context.Background()) })
	return reader, mp
}

// collect returns the named metric from the reader.
func collect(t *testing.T, r *sdkmetric.ManualReader, name string) metricdata.Aggregation {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == name {
				return m.Data
			}
		}
	}
	return nil
}

func TestTelemetryLagAndCommits(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 10, 10)
	reader, mp := newMeter(t)
	s := c.open(t, newGroup(), "orders", WithMeterProvider(mp), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))

	ds := receiveN(t, s, 10)
	ack(t, s, ds[:4]...)
	commitNow(t, s)
	commitNow(t, s) // nothing done since: no request
	lag, ok := collect(t, reader, "custody.kafka.lag").(metricdata.Gauge[int64])
	if !ok || len(lag.DataPoints) != 1 || lag.DataPoints[0].Value != 6 {
		t.Fatalf("lag = %+v, want one partition at 10-4 = 6", lag)
	}
	dur, ok := collect(t, reader, "custody.kafka.commit.duration").(metricdata.Histogram[float64])
	if !ok || len(dur.DataPoints) != 1 || dur.DataPoints[0].Count != 1 {
		t.Fatalf("commit duration = %+v, want one successful commit (the second had nothing to send)", dur)
	}

	// The coordinator refuses the next commit.
	c.refuseCommits(false)
	ack(t, s, ds[4:]...)
	if err := s.Commit(context.Background()); err == nil {
		t.Fatal("a refused commit returned nil")
	}
	fails, ok := collect(t, reader, "custody.kafka.commit.failures").(metricdata.Sum[int64])
	if !ok || len(fails.DataPoints) != 1 || fails.DataPoints[0].Value != 1 {
		t.Fatalf("commit failures = %+v, want 1", fails)
	}
	// The refused commit is retried: the next one carries it.
	commitNow(t, s)
	if offs, _ := c.committed(t, s.cfg.group, "orders"); offs[0] != 10 {
		t.Fatalf("committed %d after the retry, want 10", offs[0])
	}
	lag, _ = collect(t, reader, "custody.kafka.lag").(metricdata.Gauge[int64])
	if len(lag.DataPoints) != 1 || lag.DataPoints[0].Value != 0 {
		t.Fatalf("lag = %+v after committing everything, want 0", lag)
	}
}

// TestLagAfterARewind: after a rewind the new epoch commits below the offset
// committed before, and the lag must count from there; the data-loss notice,
// a partition error without a high watermark of its own, must not reset the
// high watermark to zero either.
func TestLagAfterARewind(t *testing.T) {
	c := newCluster(t)
	const topic = "rewind-lag"
	c.createTopic(t, topic, 1)
	produceValues(t, c, topic, 30)
	reader, mp := newMeter(t)
	group := newGroup()
	s := c.open(t, group, topic, WithMeterProvider(mp), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour),
		WithClientOptions(kgo.DisableFetchSessions(), kgo.FetchMaxWait(100*time.Millisecond)))
	ack(t, s, receiveN(t, s, 30)...)
	commitNow(t, s)

	c.loseData(t, topic, 20)
	// One poll takes the replaced records (high watermark 30) and the
	// notice; no poll follows it.
	eventually(t, "the replaced records buffered", func() bool { return s.Client().BufferedFetchRecords() >= 10 })
	if got, _ := receiveThroughLoss(t, s, 10); len(got) != 10 {
		t.Fatalf("handed out %v after the rewind; want 20..29", offsets(got))
	}
	eventually(t, "the rewind point committed", func() bool {
		offs, _ := c.committed(t, group, topic)
		return offs[0] == 20
	})
	// The group holds the commit a moment before the Source learns it was
	// accepted (the response is still on its way): wait for the gauge too.
	var lag map[int]int64
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if lag = lagByPartition(t, reader); len(lag) == 1 && lag[0] == 10 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("lag = %v with 20 committed and the high watermark at 30; want 10", lag)
		}
	}
	rewinds, _ := collect(t, reader, "custody.kafka.rewinds").(metricdata.Sum[int64])
	if len(rewinds.DataPoints) != 1 || rewinds.DataPoints[0].Value != 1 {
		t.Fatalf("custody.kafka.rewinds = %+v, want 1", rewinds)
	}
}

// TestLagGrowsWhileThePartitionIsNotFetched: fetches bring the end offset
// with their records, but a partition the Source does not fetch (paused at
// its in-flight bound, or the runtime behind) brings none. Records produced
// meanwhile must still show as lag: the Source asks the brokers for the end
// of such partitions. Without that the lag stood still exactly while it
// grew.
func TestLagGrowsWhileThePartitionIsNotFetched(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "slow", 1)
	c.produceN(t, "slow", 1, 5, 1)
	reader, mp := newMeter(t)
	s := c.open(t, newGroup(), "slow", WithMeterProvider(mp), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour),
		WithMaxUnackedPerPartition(2), WithLagRefresh(20*time.Millisecond))
	ds := receiveN(t, s, 2) // the bound: the partition is paused
	ack(t, s, ds[0])
	commitNow(t, s) // committed 1
	c.produceN(t, "slow", 1, 20, 1)
	eventually(t, "the lag to count the records produced since (25 - 1)", func() bool {
		return lagByPartition(t, reader)[0] == 24
	})
}

// lagByPartition returns the lag data points of the last collection by
// partition id.
func lagByPartition(t *testing.T, r *sdkmetric.ManualReader) map[int]int64 {
	t.Helper()
	out := map[int]int64{}
	lag, _ := collect(t, r, "custody.kafka.lag").(metricdata.Gauge[int64])
	for _, dp := range lag.DataPoints {
		v, ok := dp.Attributes.Value("messaging.destination.partition.id")
		if !ok {
			t.Fatalf("lag data point without a partition: %v", dp.Attributes.ToSlice())
		}
		id, err := strconv.Atoi(v.AsString())
		if err != nil {
			t.Fatalf("partition id %v is not a number in a string, as the conventions want", v)
		}
		out[id] = dp.Value
	}
	return out
}

// TestLagStopsForPartitionsNoLongerOwned: after a revoke (a second member
// takes a partition) and after a loss, the old owner reports no lag for the
// partitions it gave up, not even the last value it saw.
func TestLagStopsForPartitionsNoLongerOwned(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 2)
	c.produceN(t, "orders", 2, 10, 10)
	reader, mp := newMeter(t)
	group := newGroup()
	a := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour), WithMeterProvider(mp))
	ds := receiveN(t, a, 20)
	for _, d := range ds {
		if d.Offset < 6 {
			ack(t, a, d)
		}
	}
	commitNow(t, a)
	if lag := lagByPartition(t, reader); len(lag) != 2 || lag[0] != 4 || lag[1] != 4 {
		t.Fatalf("lag = %v, want 4 on both partitions", lag)
	}

	readerB := sdkmetric.NewManualReader()
	mpB := sdkmetric.NewMeterProvider(sdkmetric.WithReader(readerB))
	defer mpB.Shutdown(context.Background())
	b := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour), WithMeterProvider(mpB))
	var moved = int32(-1)
	eventually(t, "the second member to take a partition", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		got, _ := b.Receive(ctx, 100)
		if len(got) > 0 {
			moved = got[0].Partition
		}
		return moved >= 0
	})
	kept := 1 - moved
	lag := lagByPartition(t, reader)
	if _, stale := lag[int(moved)]; stale || len(lag) != 1 || lag[int(kept)] != 4 {
		t.Fatalf("old owner's lag = %v after partition %d moved, want only partition %d at 4", lag, moved, kept)
	}
	// The new owner counts from the offset committed on revoke.
	if lag := lagByPartition(t, readerB); len(lag) != 1 || lag[int(moved)] != 4 {
		t.Fatalf("new owner's lag = %v, want partition %d at 10-6 = 4", lag, moved)
	}

	a.onLost(context.Background(), a.Client(), map[string][]int32{"orders": {kept}})
	if lag := lagByPartition(t, reader); len(lag) != 0 {
		t.Fatalf("lag = %v after every partition was lost, want none", lag)
	}
}

// TestCommitDurationBucketsAreSeconds: commit.duration is in seconds, so its
// buckets must resolve the milliseconds a commit takes. The SDK's default
// boundaries (0, 5, 10, 25, ... meant for milliseconds) put every commit
// shorter than five seconds into one bucket.
func TestCommitDurationBucketsAreSeconds(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 2, 2)
	reader, mp := newMeter(t)
	s := c.open(t, newGroup(), "orders", WithMeterProvider(mp), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	ack(t, s, receiveN(t, s, 2)...)
	commitNow(t, s)
	dur, ok := collect(t, reader, "custody.kafka.commit.duration").(metricdata.Histogram[float64])
	if !ok || len(dur.DataPoints) != 1 {
		t.Fatalf("commit duration = %+v, want one data point", dur)
	}
	dp := dur.DataPoints[0]
	if v, ok := dp.Attributes.Value("error"); !ok || v.AsBool() {
		t.Errorf("commit duration attributes %v, want error=false", dp.Attributes.ToSlice())
	}
	var subSecond int
	for _, b := range dp.Bounds {
		if b > 0 && b < 1 {
			subSecond++
		}
	}
	if subSecond < 5 || dp.Bounds[0] > 0.005 || dp.Bounds[len(dp.Bounds)-1] < 10 {
		t.Fatalf("bucket boundaries %v: want several below one second, the first at most 5 ms and the last at least 10 s", dp.Bounds)
	}
}

// startAttributes is a sampler that records the attributes each span had
// when it started: what a sampler deciding on them could see.
type startAttributes struct {
	mu   sync.Mutex
	seen []attribute.Set
}

func (s *startAttributes) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	s.mu.Lock()
	s.seen = append(s.seen, attribute.NewSet(p.Attributes...))
	s.mu.Unlock()
	return sdktrace.SamplingResult{Decision: sdktrace.RecordAndSample, Tracestate: trace.SpanContextFromContext(p.ParentContext).TraceState()}
}

func (s *startAttributes) Description() string { return "startAttributes" }

// TestProcessingSpansNameTheRecordAtStart: a record's processing span
// carries, from its start, the conventions' messaging attributes with the
// record's topic, partition (a string, as the conventions want) and offset,
// so that a sampler can decide on them and a trace finds the record.
func TestProcessingSpansNameTheRecordAtStart(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 2)
	c.produceN(t, "orders", 2, 3, 3)
	sampler := &startAttributes{}
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sampler), sdktrace.WithSpanProcessor(spans))
	defer tp.Shutdown(context.Background())
	s := c.open(t, newGroup(), "orders")
	stop := runConsumer(t, s, func(context.Context, *consumer.Message) error { return nil },
		consumer.WithTracerProvider(tp), consumer.WithName("orders-consumer"))
	eventually(t, "six records processed", func() bool { return len(spans.Ended()) >= 6 })
	stop()

	sampler.mu.Lock()
	defer sampler.mu.Unlock()
	if len(sampler.seen) != 6 {
		t.Fatalf("the sampler saw %d spans start, want 6", len(sampler.seen))
	}
	seen := map[string]bool{}
	for _, attrs := range sampler.seen {
		get := func(k string) string {
			v, ok := attrs.Value(attribute.Key(k))
			if !ok {
				t.Fatalf("a span started without %s: %v", k, attrs.ToSlice())
			}
			return v.String()
		}
		for k, want := range map[string]string{
			"messaging.system":           "kafka",
			"messaging.destination.name": "orders",
			"messaging.operation.type":   "process",
			"custody.consumer":           "orders-consumer",
			"custody.attempt":            "1",
		} {
			if got := get(k); got != want {
				t.Errorf("%s = %q at start, want %q", k, got, want)
			}
		}
		if v, _ := attrs.Value("messaging.destination.partition.id"); v.Type() != attribute.STRING {
			t.Errorf("messaging.destination.partition.id is a %v, want a string", v.Type())
		}
		rec := get("messaging.destination.partition.id") + "@" + get("messaging.kafka.offset")
		if id := get("messaging.message.id"); !strings.Contains(id, "orders") {
			t.Errorf("message id %q does not name the topic", id)
		}
		seen[rec] = true
	}
	for p := 0; p < 2; p++ {
		for o := 0; o < 3; o++ {
			if rec := fmt.Sprintf("%d@%d", p, o); !seen[rec] {
				t.Errorf("no span started for partition %d offset %d; saw %v", p, o, seen)
			}
		}
	}
}

// refuseCommits makes the coordinator refuse the next offset commit, or
// every one from now on, with GROUP_AUTHORIZATION_FAILED for each partition.
func (c *cluster) refuseCommits(every bool) {
	c.fake.ControlKey(int16(kmsg.OffsetCommit), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		if every {
			c.fake.KeepControl()
		}
		return offsetCommitResponse(kreq.(*kmsg.OffsetCommitRequest), kerr.GroupAuthorizationFailed.Code), nil, true
	})
}

// offsetCommitResponse answers every partition of req with the error code
// (0: committed).
func offsetCommitResponse(req *kmsg.OffsetCommitRequest, code int16) *kmsg.OffsetCommitResponse {
	resp := req.ResponseKind().(*kmsg.OffsetCommitResponse)
	for _, rt := range req.Topics {
		st := kmsg.NewOffsetCommitResponseTopic()
		st.Topic, st.TopicID = rt.Topic, rt.TopicID
		for _, rp := range rt.Partitions {
			sp := kmsg.NewOffsetCommitResponseTopicPartition()
			sp.Partition, sp.ErrorCode = rp.Partition, code
			st.Partitions = append(st.Partitions, sp)
		}
		resp.Topics = append(resp.Topics, st)
	}
	return resp
}
