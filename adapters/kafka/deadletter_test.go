package kafka

import (
	"context"
	"crypto/rand"
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// readTopic reads every record of topic from the start until it holds n.
func (c *cluster) readTopic(t testing.TB, topic string, n int) []*kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.addrs...), kgo.ConsumeTopics(topic), kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out []*kgo.Record
	for len(out) < n {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("read %d of %d records from %s: %v", len(out), n, topic, err)
		}
		out = append(out, fs.Records()...)
	}
	return out
}

// failProduceTo makes the cluster refuse produce requests to topic while the
// returned flag is set.
func failProduceTo(t testing.TB, cl *cluster, topic string) *atomic.Bool {
	t.Helper()
	td, err := cl.admin.ListTopics(context.Background(), topic)
	if err != nil || td[topic].Err != nil {
		t.Fatalf("listing %s: %v %v", topic, err, td[topic].Err)
	}
	id := td[topic].ID
	c := cl.fake
	var on atomic.Bool
	on.Store(true)
	c.ControlKey(int16(kmsg.Produce), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		req := kreq.(*kmsg.ProduceRequest)
		if !on.Load() {
			return nil, nil, false
		}
		match := false
		for _, rt := range req.Topics {
			match = match || rt.Topic == topic || rt.TopicID == id
		}
		if !match {
			return nil, nil, false
		}
		resp := req.ResponseKind().(*kmsg.ProduceResponse)
		for _, rt := range req.Topics {
			st := kmsg.NewProduceResponseTopic()
			st.Topic, st.TopicID = rt.Topic, rt.TopicID
			for _, rp := range rt.Partitions {
				sp := kmsg.NewProduceResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.ErrorCode = kerr.TopicAuthorizationFailed.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})
	return &on
}

func TestDeadLetterCarriesTheRecordAndDiagnostics(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.createTopic(t, "orders.dlq", 1)
	c.produce(t, &kgo.Record{Topic: "orders", Key: []byte("k1"), Value: []byte("poison"),
		Headers: []kgo.RecordHeader{{Key: "traceparent", Value: []byte("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")}}})
	group := newGroup()
	s := c.open(t, group, "orders")
	dl := sinkOf(t, s, "orders.dlq")

	d := receiveN(t, s, 1)[0]
	now := time.Now()
	f := adapters.Failure{Err: errors.New("cannot parse"), Permanent: true, Attempts: 3, FirstFailure: now.Add(-time.Second), LastFailure: now}
	if err := dl.Send(context.Background(), d, f); err != nil {
		t.Fatalf("send: %v", err)
	}
	r := c.readTopic(t, "orders.dlq", 1)[0]
	if string(r.Key) != "k1" || string(r.Value) != "poison" {
		t.Fatalf("dead letter key/value %q/%q, want the original", r.Key, r.Value)
	}
	h := map[string]string{}
	for _, rh := range r.Headers {
		h[rh.Key] = string(rh.Value)
	}
	want := map[string]string{
		"traceparent":                 "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		adapters.HeaderOriginalQueue:  "orders",
		adapters.HeaderOriginalPart:   "0",
		adapters.HeaderOriginalOffset: "0",
		adapters.HeaderError:          "cannot parse",
		adapters.HeaderAttempts:       "3",
		adapters.HeaderPermanent:      "true",
		adapters.HeaderConsumer:       group,
		HeaderGroup:                   group,
		adapters.HeaderOriginalKey:    "k1",
	}
	for k, v := range want {
		if h[k] != v {
			t.Errorf("header %s = %q, want %q", k, h[k], v)
		}
	}
	if h[adapters.HeaderOriginalTime] == "" {
		t.Errorf("no original timestamp header")
	}
}

// A refused dead-letter produce returns an error (so the original is not
// acked and its offset not committed); once the topic accepts again, Send
// succeeds.
func TestDeadLetterFailedProduceReturnsError(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.createTopic(t, "orders.dlq", 1)
	c.produceN(t, "orders", 1, 1, 1)
	s := c.open(t, newGroup(), "orders")
	dl := sinkOf(t, s, "orders.dlq")
	d := receiveN(t, s, 1)[0]

	refuse := failProduceTo(t, c, "orders.dlq")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := dl.Send(ctx, d, adapters.Failure{Err: errors.New("boom"), Attempts: 5}); err == nil {
		t.Fatal("send returned nil although the produce was refused")
	}
	refuse.Store(false)
	if err := dl.Send(ctx, d, adapters.Failure{Err: errors.New("boom"), Attempts: 5}); err != nil {
		t.Fatalf("send after the topic accepts again: %v", err)
	}
	if got := c.readTopic(t, "orders.dlq", 1); len(got) != 1 {
		t.Fatalf("dead-letter topic holds %d records, want 1", len(got))
	}
}

// A sink made from the Source produces through the Source's client: its
// Close leaves the client to the Source, which goes on receiving, and its
// Send works until the Source is closed.
func TestSourceDeadLetterProducesThroughTheSourceClient(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.createTopic(t, "orders.dlq", 1)
	c.produceN(t, "orders", 1, 2, 2)
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(Unordered))
	dl := sinkOf(t, s, "orders.dlq")
	if dl.cl != s.cl {
		t.Fatal("the sink made its own client")
	}
	ds := receiveN(t, s, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := dl.Close(); err != nil {
		t.Fatal(err)
	}
	if err := dl.Send(ctx, ds[0], adapters.Failure{Err: errors.New("boom"), Attempts: 1}); err != nil {
		t.Fatalf("Send after the sink's Close: %v", err)
	}
	ds = append(ds, receiveN(t, s, 1)...)
	r := c.readTopic(t, "orders.dlq", 1)[0]
	h := map[string]string{}
	for _, rh := range r.Headers {
		h[rh.Key] = string(rh.Value)
	}
	if h[HeaderGroup] != group || h[adapters.HeaderOriginalOffset] != "0" {
		t.Fatalf("dead letter headers %v, want the Source's group %s and offset 0", h, group)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := dl.Send(ctx, ds[1], adapters.Failure{Err: errors.New("boom"), Attempts: 1}); err == nil {
		t.Fatal("Send after the Source was closed returned nil")
	}
}

// A copy too large for the dead-letter topic (its max.message.bytes, or the
// producer's own limit) cannot be retried into fitting: the error says so,
// names the two limits to raise, and keeps the client's error.
func TestDeadLetterTooLargeSaysWhatToRaise(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	limit := "4096"
	resp, err := c.admin.CreateTopic(ctx, 1, 1, map[string]*string{"max.message.bytes": &limit}, "orders.dlq")
	if err == nil {
		err = resp.Err
	}
	if err != nil {
		t.Fatal(err)
	}
	// Random bytes, so that compression does not bring the copy under
	// the limit.
	value := make([]byte, 5000)
	_, _ = rand.Read(value)
	c.produce(t, &kgo.Record{Topic: "orders", Key: []byte("k"), Value: value})
	s := c.open(t, newGroup(), "orders")
	d := receiveN(t, s, 1)[0]
	f := adapters.Failure{Err: errors.New("cannot parse"), Permanent: true, Attempts: 1}

	for name, opts := range map[string][]kgo.Opt{
		"the topic's limit":    nil,
		"the producer's limit": {kgo.ProducerBatchMaxBytes(2048)},
	} {
		dl, err := NewDeadLetter(ctx, "orders.dlq", WithBrokers(c.addrs...), WithClientOptions(opts...))
		if err != nil {
			t.Fatal(err)
		}
		err = dl.Send(ctx, d, f)
		dl.Close()
		if !errors.Is(err, kerr.MessageTooLarge) && !errors.Is(err, kerr.RecordListTooLarge) {
			t.Fatalf("%s: Send = %v, want the client's too-large error", name, err)
		}
		for _, want := range []string{"max.message.bytes", "kgo.ProducerBatchMaxBytes", "too large for topic \"orders.dlq\""} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s: Send = %q, want it to say %q", name, err, want)
			}
		}
	}
	ends, err := c.admin.ListEndOffsets(ctx, "orders.dlq")
	if err != nil {
		t.Fatal(err)
	}
	if o, _ := ends.Lookup("orders.dlq", 0); o.Offset != 0 {
		t.Fatalf("the dead-letter topic ends at %d, want 0: nothing written", o.Offset)
	}
}

// A delivery that is not a Kafka record (a Kafka dead-letter topic behind
// another broker's source) is copied from the delivery itself: its key, its
// body and its headers, an earlier trip's diagnostics excepted (the group
// header too, which a sink without a group does not write anew).
func TestDeadLetterCopiesADeliveryFromAnotherBroker(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders.dlq", 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dl, err := NewDeadLetter(ctx, "orders.dlq", WithBrokers(c.addrs...))
	if err != nil {
		t.Fatal(err)
	}
	defer dl.Close()
	d := &adapters.Delivery{
		ID: "m-1", Queue: "orders-queue", Partition: -1, Offset: -1, Key: "customer-7", Body: []byte("poison"),
		Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", adapters.HeaderError: "an earlier failure", HeaderGroup: "an earlier group"},
	}
	if err := dl.Send(ctx, d, adapters.Failure{Err: errors.New("cannot parse"), Permanent: true, Attempts: 1}); err != nil {
		t.Fatalf("send: %v", err)
	}
	r := c.readTopic(t, "orders.dlq", 1)[0]
	if string(r.Key) != "customer-7" || string(r.Value) != "poison" {
		t.Fatalf("dead letter key/value %q/%q, want the delivery's", r.Key, r.Value)
	}
	h := map[string][]string{}
	for _, rh := range r.Headers {
		h[rh.Key] = append(h[rh.Key], string(rh.Value))
	}
	for k, v := range map[string]string{
		"traceparent":                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		adapters.HeaderError:         "cannot parse",
		adapters.HeaderOriginalQueue: "orders-queue",
		adapters.HeaderOriginalID:    "m-1",
	} {
		if !slices.Equal(h[k], []string{v}) {
			t.Errorf("header %s = %q, want only %q", k, h[k], v)
		}
	}
	if g, ok := h[HeaderGroup]; ok {
		t.Errorf("header %s = %q, copied from an earlier trip by a sink without a group", HeaderGroup, g)
	}
}
