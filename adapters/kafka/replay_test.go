package kafka

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/testkit/testlog"
	"github.com/twmb/franz-go/pkg/kgo"
)

// deadLetters produces n records to topic (keyed k<i%3>, valued v<i>, with
// a header, partitioned by key) and sends each to the dead-letter topic dlt through a
// DeadLetter sink, as the runtime does, with error "boom <i%2>".
func (c *cluster) deadLetters(t *testing.T, topic, dlt string, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	dl, err := NewDeadLetter(ctx, dlt, WithBrokers(c.addrs...), WithGroup("orders-service"), WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	defer dl.Close()
	// The default partitioner, by key, as producers use it.
	prod, err := kgo.NewClient(kgo.SeedBrokers(c.addrs...), kgo.ProducerLinger(0))
	if err != nil {
		t.Fatal(err)
	}
	defer prod.Close()
	for i := range n {
		rec := &kgo.Record{Topic: topic, Key: []byte(fmt.Sprintf("k%d", i%3)), Value: []byte(fmt.Sprintf("v%d", i)),
			Headers: []kgo.RecordHeader{{Key: "origin", Value: []byte("test")}}}
		if err := prod.ProduceSync(ctx, rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
		d := &adapters.Delivery{ID: fmt.Sprintf("%s/%d/%d", topic, rec.Partition, rec.Offset), Queue: topic,
			Partition: rec.Partition, Offset: rec.Offset, Key: string(rec.Key), Body: rec.Value, Native: rec}
		now := time.Now()
		if err := dl.Send(ctx, d, adapters.Failure{Err: fmt.Errorf("boom %d", i%2), Attempts: 3, FirstFailure: now, LastFailure: now}); err != nil {
			t.Fatal(err)
		}
	}
}

// readCommitted returns every record of topic a read-committed consumer
// sees, reading until it has reached the ends the partitions have now.
func (c *cluster) readCommitted(t *testing.T, topic string) []*kgo.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	ends, err := c.admin.ListCommittedOffsets(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.addrs...), kgo.ConsumeTopics(topic),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.KeepControlRecords(), kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	left := map[int32]int64{}
	for p, e := range ends[topic] {
		if e.Offset > 0 {
			left[p] = e.Offset
		}
	}
	var out []*kgo.Record
	for len(left) > 0 {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("reading %s: timed out with partitions %v not read to their ends", topic, left)
		}
		fs.EachRecord(func(r *kgo.Record) {
			if r.Offset+1 >= left[r.Partition] {
				delete(left, r.Partition)
			}
			if !r.Attrs.IsControl() {
				out = append(out, r)
			}
		})
	}
	return out
}

func (c *cluster) newReplay(t *testing.T, dlt, group string) *Replay {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := NewReplay(ctx, dlt, WithBrokers(c.addrs...), WithGroup(group), WithLogger(testlog.New(t)),
		WithClientOptions(kgo.FetchMaxWait(100*time.Millisecond), kgo.HeartbeatInterval(100*time.Millisecond)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r
}

func header(r *kgo.Record, k string) (string, bool) {
	for _, h := range r.Headers {
		if h.Key == k {
			return string(h.Value), true
		}
	}
	return "", false
}

// List reads the dead letters with their diagnostics, and is a dry run:
// it commits nothing, so a replay after it sees every one.
func TestReplayListIsADryRun(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 3)
	c.createTopic(t, "orders.dlq", 2)
	c.deadLetters(t, "orders", "orders.dlq", 10)
	group := newGroup()
	r := c.newReplay(t, "orders.dlq", group)
	ctx := context.Background()

	recs, err := r.List(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 10 {
		t.Fatalf("listed %d dead letters, want 10", len(recs))
	}
	for _, rec := range recs {
		if rec.OriginalQueue != "orders" || !strings.HasPrefix(rec.Error, "boom ") || rec.Attempts != 3 ||
			rec.Consumer != "orders-service" || rec.Headers["origin"] != "test" || !strings.HasPrefix(rec.Key, "k") ||
			!strings.HasPrefix(rec.ID, "orders.dlq/") || rec.Offset < 0 || rec.Diagnostics[HeaderGroup] != "orders-service" {
			t.Fatalf("listed %+v", rec)
		}
		if _, ok := rec.Headers[HeaderGroup]; ok {
			t.Fatalf("%s among the original headers of %s", HeaderGroup, rec.ID)
		}
	}
	groups := adapters.GroupDeadLetters(recs)
	if len(groups) != 2 || groups[0].Count != 5 || groups[1].Count != 5 {
		t.Fatalf("grouped into %+v, want two groups of 5", groups)
	}
	if few, err := r.List(ctx, 3); err != nil || len(few) != 3 {
		t.Fatalf("List(3) = %d records, %v", len(few), err)
	}
	if offs, err := c.admin.FetchOffsets(ctx, group); err == nil && len(offs) > 0 {
		t.Fatalf("List committed offsets %v for the replay group", offs)
	}
	res, err := r.Replay(ctx, adapters.ReplayOptions{Rate: 1000})
	if err != nil || res.Replayed != 10 {
		t.Fatalf("Replay after List = %+v, %v; want all 10", res, err)
	}
	if again, err := r.List(ctx, 100); err != nil || len(again) != 0 {
		t.Fatalf("List after the replay = %d records, %v; want none (behind the group's offsets)", len(again), err)
	}
}

// The copies go back to the original topic with the dead letter's key,
// value and headers, without the diagnostics, with custody-replay-of; with
// KeepDiagnostics, the diagnostics packed in one header. Dead letters left
// out by the selection are passed and counted skipped; Max stops the run
// at the dead letter that reaches it, and the next run starts after it.
func TestReplayCopiesSelectedDeadLettersBack(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 3)
	c.createTopic(t, "orders.dlq", 1)
	c.deadLetters(t, "orders", "orders.dlq", 10)
	r := c.newReplay(t, "orders.dlq", newGroup())
	ctx := context.Background()

	sel := func(d adapters.DeadLetterRecord) bool { return d.Error == "boom 0" }
	res, err := r.Replay(ctx, adapters.ReplayOptions{Select: sel, Rate: 1000, Max: 2, KeepDiagnostics: true})
	if err != nil || res.Replayed != 2 || res.Skipped != 1 {
		t.Fatalf("first run = %+v, %v; want 2 replayed and the 1 between them skipped", res, err)
	}
	res, err = r.Replay(ctx, adapters.ReplayOptions{Select: sel, Rate: 1000})
	if err != nil || res.Replayed != 3 || res.Skipped != 4 {
		t.Fatalf("second run = %+v, %v; want the 3 left replayed and 4 skipped", res, err)
	}
	res, err = r.Replay(ctx, adapters.ReplayOptions{Rate: 1000})
	if err != nil || res != (adapters.ReplayResult{}) {
		t.Fatalf("a run with nothing left = %+v, %v; want nothing", res, err)
	}

	all := c.readCommitted(t, "orders")
	var originals, copies []*kgo.Record
	for _, rec := range all {
		if _, ok := header(rec, adapters.HeaderReplayOf); ok {
			copies = append(copies, rec)
		} else {
			originals = append(originals, rec)
		}
	}
	if len(copies) != 5 {
		t.Fatalf("%d copies in orders, want 5", len(copies))
	}
	seen := map[string]bool{}
	packedN := 0
	for i, cp := range copies {
		of, ok := header(cp, adapters.HeaderReplayOf)
		if !ok || !strings.HasPrefix(of, "orders.dlq/0/") || seen[of] {
			t.Fatalf("copy %d: custody-replay-of %q", i, of)
		}
		seen[of] = true
		var n int
		if _, err := fmt.Sscanf(string(cp.Value), "v%d", &n); err != nil || n%2 != 0 || string(cp.Key) != fmt.Sprintf("k%d", n%3) {
			t.Fatalf("copy %d: key %q value %q; want an even v<n> under k<n%%3>", i, cp.Key, cp.Value)
		}
		if origin, _ := header(cp, "origin"); origin != "test" {
			t.Fatalf("copy %d lost the original header", i)
		}
		for _, h := range cp.Headers {
			if adapters.IsDiagnosticHeader(h.Key) && h.Key != adapters.HeaderReplayOf && h.Key != adapters.HeaderReplayDiagnostics || h.Key == HeaderGroup {
				t.Fatalf("copy %d carries diagnostic %s", i, h.Key)
			}
		}
		packed, kept := header(cp, adapters.HeaderReplayDiagnostics)
		if kept {
			packedN++
			var diag map[string]string
			if err := json.Unmarshal([]byte(packed), &diag); err != nil || diag[adapters.HeaderError] != "boom 0" || diag[HeaderGroup] != "orders-service" {
				t.Fatalf("copy %d: packed diagnostics %s (%v)", i, packed, err)
			}
		}
	}
	if packedN != 2 {
		t.Fatalf("%d copies carry %s, want the first run's 2", packedN, adapters.HeaderReplayDiagnostics)
	}
	// The key's partition order holds: a copy lands where its key's
	// records are.
	part := map[string]int32{}
	for _, rec := range originals {
		part[string(rec.Key)] = rec.Partition
	}
	for i, cp := range copies {
		if part[string(cp.Key)] != cp.Partition {
			t.Fatalf("copy %d of key %s went to partition %d, its key's records are in %d", i, cp.Key, cp.Partition, part[string(cp.Key)])
		}
	}
}

// A replay cut short between producing its copies and ending its
// transaction loses nothing and copies nothing twice, whether its process
// dies there (the transaction stays open; the next run takes over the
// transactional ID, which aborts it) or its context ends (it aborts the
// transaction itself): the next run copies those dead letters again, and a
// read-committed consumer sees each dead letter once in the original
// topic.
func TestReplayCutShortMovesEveryDeadLetterOnce(t *testing.T) {
	for _, mode := range []string{"dies", "cancelled"} {
		t.Run(mode, func(t *testing.T) { testReplayCutShort(t, mode) })
	}
}

func testReplayCutShort(t *testing.T, mode string) {
	c := newCluster(t)
	c.createTopic(t, "orders", 3)
	c.createTopic(t, "orders.dlq", 2)
	c.deadLetters(t, "orders", "orders.dlq", 30)
	group := newGroup()
	r := c.newReplay(t, "orders.dlq", group)
	r.txnSpan = 250 * time.Millisecond // at 20 a second, transactions of 5
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// The first run commits its first transaction, and is cut in its
	// second, with its copies produced.
	var abandoned []*kgo.GroupTransactSession
	ends := 0
	r.testHookBeforeEnd = func(s *kgo.GroupTransactSession) error {
		if ends++; ends != 2 {
			return nil
		}
		if mode == "cancelled" {
			cancel()
			return nil
		}
		abandoned = append(abandoned, s)
		return errAbandon
	}
	res, err := r.Replay(ctx, adapters.ReplayOptions{Rate: 20})
	want := errAbandon
	if mode == "cancelled" {
		want = context.Canceled
	}
	if !errors.Is(err, want) {
		t.Fatalf("the cut run = %+v, %v; want %v", res, err, want)
	}
	for _, s := range abandoned {
		s.Client().Close() // leaves the group; its transaction stays open
	}
	first := res.Replayed
	if first == 0 || first >= 30 {
		t.Fatalf("the cut run replayed %d before its cut, want some and not all", first)
	}
	r.testHookBeforeEnd = nil
	res, err = r.Replay(context.Background(), adapters.ReplayOptions{Rate: 1000})
	if err != nil {
		t.Fatal(err)
	}
	if first+res.Replayed != 30 {
		t.Fatalf("replayed %d then %d, want 30 in all", first, res.Replayed)
	}
	var copies []*kgo.Record
	count := map[string]int{}
	for _, rec := range c.readCommitted(t, "orders") {
		if of, ok := header(rec, adapters.HeaderReplayOf); ok {
			copies = append(copies, rec)
			count[of]++
		}
	}
	var dups []string
	for of, n := range count {
		if n > 1 {
			dups = append(dups, of)
		}
	}
	slices.Sort(dups)
	if len(copies) != 30 || len(count) != 30 || len(dups) > 0 {
		t.Fatalf("%d copies of %d dead letters, copied more than once: %v; want each of the 30 once", len(copies), len(count), dups)
	}
	offs, _ := c.committed(t, group, "orders.dlq")
	ends2, _ := c.admin.ListEndOffsets(context.Background(), "orders.dlq")
	for p, e := range ends2["orders.dlq"] {
		if offs[p] != e.Offset {
			t.Fatalf("the replay group committed %d on partition %d, want its end %d", offs[p], p, e.Offset)
		}
	}
}

// Bad options fail at once, naming the option.
func TestReplayRefusesBadOptions(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders.dlq", 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	quiet := WithLogger(testlog.New(t))
	for _, tc := range []struct {
		name  string
		topic string
		opts  []Option
		want  string
	}{
		{"no topic", "", []Option{WithBrokers(c.addrs...), WithGroup("g")}, "dead-letter topic must not be empty"},
		{"no brokers", "orders.dlq", []Option{WithGroup("g")}, "WithBrokers is required"},
		{"no group", "orders.dlq", []Option{WithBrokers(c.addrs...)}, "WithGroup is required"},
		{"a Source option", "orders.dlq", []Option{WithBrokers(c.addrs...), WithGroup("g"), WithPollWait(time.Second)}, "WithPollWait only apply to a Source"},
		{"no such topic", "nope", []Option{WithBrokers(c.addrs...), WithGroup("g")}, `"nope" does not exist`},
	} {
		r, err := NewReplay(ctx, tc.topic, append(tc.opts, quiet)...)
		if err == nil {
			r.Close()
			t.Fatalf("%s: NewReplay succeeded", tc.name)
		}
		if !strings.Contains(err.Error(), tc.want) {
			t.Fatalf("%s: NewReplay = %v; want it to say %q", tc.name, err, tc.want)
		}
	}
	r := c.newReplay(t, "orders.dlq", newGroup())
	for _, tc := range []struct {
		o    adapters.ReplayOptions
		want string
	}{
		{adapters.ReplayOptions{Rate: -1}, "ReplayOptions.Rate"},
		{adapters.ReplayOptions{Rate: math.NaN()}, "ReplayOptions.Rate"},
		{adapters.ReplayOptions{Max: -1}, "ReplayOptions.Max"},
	} {
		if _, err := r.Replay(ctx, tc.o); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Fatalf("Replay(%+v) = %v; want it to name %s", tc.o, err, tc.want)
		}
	}
	if _, err := r.List(ctx, 0); err == nil || !strings.Contains(err.Error(), "max") {
		t.Fatalf("List(0) = %v; want it to name max", err)
	}
}

// A dead letter that names no original topic stops the run with an error
// naming it; the dead letters before it are replayed, it and those after it
// stay.
func TestReplayStopsAtADeadLetterWithoutOrigin(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.createTopic(t, "orders.dlq", 1)
	c.deadLetters(t, "orders", "orders.dlq", 2)
	c.produce(t, &kgo.Record{Topic: "orders.dlq", Value: []byte("stray")})
	group := newGroup()
	r := c.newReplay(t, "orders.dlq", group)
	c.deadLetters(t, "orders", "orders.dlq", 1)
	res, err := r.Replay(context.Background(), adapters.ReplayOptions{Rate: 1000})
	if err == nil || !strings.Contains(err.Error(), "orders.dlq/0/2") || !strings.Contains(err.Error(), "names no original topic") || res.Replayed != 2 {
		t.Fatalf("Replay = %+v, %v; want the 2 before it replayed, and it stopped at orders.dlq/0/2, saying it names no original topic", res, err)
	}
	recs, err := r.List(context.Background(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 2 || recs[0].ID != "orders.dlq/0/2" {
		t.Fatalf("after the failed run, listed %+v; want the stray one and the one after it", recs)
	}
	res, err = r.Replay(context.Background(), adapters.ReplayOptions{Rate: 1000,
		Select: func(d adapters.DeadLetterRecord) bool { return d.OriginalQueue != "" }})
	if err != nil || res.Replayed != 1 || res.Skipped != 1 {
		t.Fatalf("Replay selecting it out = %+v, %v; want 1 replayed, 1 skipped", res, err)
	}
}

// abortedDeadLetters writes n records to partition 0 of dead-letter topic
// dlt in a transaction of the cluster's transactional producer and aborts
// it: records that would be copied back to topic "orders" (they name it)
// were they read, followed by their abort marker.
func (c *cluster) abortedDeadLetters(t *testing.T, dlt string, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	before, err := c.admin.ListEndOffsets(ctx, dlt)
	if err != nil {
		t.Fatal(err)
	}
	cl := c.txnProducer(t, dlt)
	if err := cl.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		rec := &kgo.Record{Topic: dlt, Partition: 0, Key: []byte("k0"), Value: []byte(fmt.Sprintf("aborted%d", i)),
			Headers: []kgo.RecordHeader{{Key: adapters.HeaderOriginalQueue, Value: []byte("orders")}}}
		if err := cl.ProduceSync(ctx, rec).FirstErr(); err != nil {
			t.Fatalf("producing in a transaction: %v", err)
		}
	}
	if err := cl.EndTransaction(ctx, kgo.TryAbort); err != nil {
		t.Fatalf("aborting the transaction: %v", err)
	}
	after, err := c.admin.ListEndOffsets(ctx, dlt)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := before.Lookup(dlt, 0)
	a, _ := after.Lookup(dlt, 0)
	if a.Offset != b.Offset+int64(n)+1 {
		t.Fatalf("partition 0 of %s ends at %d after the aborted transaction, was %d; want %d records and a marker", dlt, a.Offset, b.Offset, n)
	}
	lso, err := c.admin.ListCommittedOffsets(ctx, dlt)
	if err != nil {
		t.Fatal(err)
	}
	if l, _ := lso.Lookup(dlt, 0); l.Offset != a.Offset {
		t.Fatalf("partition 0 of %s: last stable offset %d, end %d; want the aborted transaction closed", dlt, l.Offset, a.Offset)
	}
}

// A partition whose last offsets before the run's end are an aborted
// transaction and its marker, however the run reaches them (after dead
// letters it copies, or as all that is left beyond the group's offset),
// ends the run: read committed, the aborted records are dropped, and the
// marker (kept, a control record) reaches the end. No aborted record is
// copied, and the group moves past the marker.
func TestReplayEndsAtAnAbortedTransaction(t *testing.T) {
	for _, mode := range []string{"after dead letters", "only content left"} {
		t.Run(mode, func(t *testing.T) {
			c := newCluster(t)
			c.createTopic(t, "orders", 3)
			c.createTopic(t, "orders.dlq", 1)
			c.deadLetters(t, "orders", "orders.dlq", 5)
			group := newGroup()
			r := c.newReplay(t, "orders.dlq", group)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			want := 5
			if mode == "only content left" {
				res, err := r.Replay(ctx, adapters.ReplayOptions{Rate: 1000})
				if err != nil || res.Replayed != 5 {
					t.Fatalf("the first run = %+v, %v; want the 5 dead letters replayed", res, err)
				}
				want = 0
			}
			c.abortedDeadLetters(t, "orders.dlq", 3)
			res, err := r.Replay(ctx, adapters.ReplayOptions{Rate: 1000})
			if err != nil || res.Replayed != want || res.Skipped != 0 {
				t.Fatalf("Replay = %+v, %v; want %d replayed, none skipped, and the run ended", res, err, want)
			}
			copies := 0
			for _, rec := range c.readCommitted(t, "orders") {
				if _, ok := header(rec, adapters.HeaderReplayOf); !ok {
					continue
				}
				copies++
				if strings.HasPrefix(string(rec.Value), "aborted") {
					t.Fatalf("an aborted record was copied: %q", rec.Value)
				}
			}
			if copies != 5 {
				t.Fatalf("%d copies in orders, want the 5 dead letters'", copies)
			}
			offs, _ := c.committed(t, group, "orders.dlq")
			ends, err := c.admin.ListEndOffsets(context.Background(), "orders.dlq")
			if err != nil {
				t.Fatal(err)
			}
			if e, _ := ends.Lookup("orders.dlq", 0); offs[0] != e.Offset {
				t.Fatalf("the replay group committed %d, want the end %d (past the abort marker)", offs[0], e.Offset)
			}
			if recs, err := r.List(ctx, 10); err != nil || len(recs) != 0 {
				t.Fatalf("List after the run = %+v, %v; want nothing", recs, err)
			}
		})
	}
}
