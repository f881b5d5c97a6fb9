package awssqs

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

func TestFIFOGroupOrderUnderConcurrency(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(true, 10*time.Second, nil)
	const groups, perGroup = 4, 12
	for i := range perGroup {
		for g := range groups {
			e.send(url, fmt.Sprintf("g%d-%d", g, i), fmt.Sprintf("g%d", g), nil)
		}
	}
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu               sync.Mutex
		seen             = map[string][]int{}
		running          = map[string]bool{}
		active, maxAlive int
		overlaps         []string
		keys             []string
		total            int
	)
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		g, n, _ := strings.Cut(string(m.Body), "-")
		i, _ := strconv.Atoi(n)
		mu.Lock()
		if running[g] {
			overlaps = append(overlaps, string(m.Body))
		}
		running[g] = true
		active++
		maxAlive = max(maxAlive, active)
		keys = append(keys, m.Key)
		mu.Unlock()
		time.Sleep(20 * time.Millisecond) // long enough for groups to overlap
		mu.Lock()
		defer mu.Unlock()
		running[g] = false
		active--
		seen[g] = append(seen[g], i)
		total++
		return nil
	})
	runUntil(t, src, h, "every message handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return total >= groups*perGroup
	}, consumer.WithConcurrency(8), consumer.WithOrdering(consumer.OrderByKey))
	mu.Lock()
	defer mu.Unlock()
	if len(overlaps) > 0 {
		t.Fatalf("messages of one group ran concurrently: %v", overlaps)
	}
	for g, got := range seen {
		for i, n := range got {
			if n != i {
				t.Fatalf("group %s handled out of order: %v", g, got)
			}
		}
	}
	if maxAlive < 2 {
		t.Errorf("at most %d handler ran at once; other groups must run concurrently", maxAlive)
	}
	for _, k := range keys {
		if !strings.HasPrefix(k, "g") {
			t.Fatalf("Message.Key = %q, want the MessageGroupId", k)
		}
	}
	t.Logf("up to %d groups ran at once", maxAlive)
}

func TestFIFOIDsVisibleOnMessage(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(true, 10*time.Second, nil)
	e.send(url, "hello", "grp", map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ds := receiveAtLeast(t, src, 1)
	d := ds[0]
	if d.Key != "grp" || d.OrderingKey != "grp" || GroupID(d) != "grp" {
		t.Errorf("Key %q, OrderingKey %q, GroupID %q; want the group id", d.Key, d.OrderingKey, GroupID(d))
	}
	if DeduplicationID(d) == "" {
		t.Error("DeduplicationID is empty on a FIFO message")
	}
	if d.Attempt != 1 || d.PublishedAt.IsZero() || d.FirstReceivedAt.IsZero() {
		t.Errorf("Attempt %d, PublishedAt %v, FirstReceivedAt %v", d.Attempt, d.PublishedAt, d.FirstReceivedAt)
	}
	if d.Headers["traceparent"] == "" {
		t.Errorf("trace context attribute not in Headers: %v", d.Headers)
	}
	if !src.Capabilities().Ordered {
		t.Error("a FIFO source must report Ordered")
	}
	if err := src.Ack(e.ctx(), ds); err != nil {
		t.Fatal(err)
	}
}

// receiveAtLeast calls Receive until it has n deliveries.
func receiveAtLeast(t *testing.T, src *Source, n int) []*adapters.Delivery {
	t.Helper()
	var ds []*adapters.Delivery
	deadline := time.Now().Add(patience)
	for len(ds) < n {
		if time.Now().After(deadline) {
			t.Fatalf("received %d of %d messages", len(ds), n)
		}
		ctx, cancel := context.WithTimeout(context.Background(), patience)
		got, err := src.Receive(ctx, n-len(ds))
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		ds = append(ds, got...)
	}
	return ds
}

func TestShutdownReleasesUnfinished(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	// A long visibility timeout: a message not released would stay
	// invisible for the rest of the test.
	url, _ := e.queue(false, 5*time.Minute, nil)
	const n = 20
	for i := range n {
		e.send(url, fmt.Sprint(i), "", nil)
	}
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu      sync.Mutex
		started int
	)
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		started++
		mu.Unlock()
		<-ctx.Done() // never finishes on its own
		return context.Cause(ctx)
	})
	runUntil(t, src, h, "handlers running and messages waiting for them", func() bool {
		mu.Lock()
		defer mu.Unlock()
		_, inFlight := e.counts(url)
		return started == 2 && inFlight >= 4
	}, consumer.WithConcurrency(2), consumer.WithShutdownTimeout(300*time.Millisecond))
	// Released messages are visible at once; one not released would stay
	// invisible for five minutes. (The emulator's message counts are not
	// reliable after visibility changes, so receive them instead.)
	if got := distinctBodies(e.drain(url, 2*time.Second)); got != n {
		t.Errorf("received %d distinct messages right after shutdown, want all %d released", got, n)
	}
}

func distinctBodies(ms []types.Message) int {
	seen := map[string]bool{}
	for _, m := range ms {
		seen[aws.ToString(m.Body)] = true
	}
	return len(seen)
}

// TestStaleReceiptHandle: consumer a's visibility timeout runs out while it
// holds two messages; consumer b receives and finishes them. a's next
// heartbeat, batched with a third message a holds validly, must fail for the
// two stale entries alone, as lost leases, counted; the valid one is
// renewed, and the batch is not resent. In the end each message is deleted
// once and nothing comes back.
//
// (The emulator, unlike SQS, accepts a stale handle while the message is in
// flight under a newer one, so the stale messages here are ones b deleted.)
func TestStaleReceiptHandle(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 2*time.Second, nil)
	e.send(url, "m0", "", nil)
	e.send(url, "m1", "", nil)
	a, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()

	stale := receiveAtLeast(t, a, 2)
	time.Sleep(2500 * time.Millisecond) // a's visibility timeout runs out
	again := receiveAtLeast(t, b, 2)
	if err := b.Ack(e.ctx(), again); err != nil {
		t.Fatalf("b acks m0 and m1: %v", err)
	}
	e.send(url, "m2", "", nil)
	fresh := receiveAtLeast(t, a, 1)

	batch := append(append([]*adapters.Delivery{}, stale...), fresh...)
	before := e.counter.Op("ChangeMessageVisibilityBatch")
	err = a.Extend(e.ctx(), batch, 30*time.Second)
	if sent := e.counter.Op("ChangeMessageVisibilityBatch") - before; sent != 1 {
		t.Errorf("the heartbeat took %d requests, want 1 (no resend of the batch)", sent)
	}
	var be *adapters.BatchError
	if !errors.As(err, &be) || len(be.Failed) != 2 || be.Failed[2] != nil {
		t.Fatalf("heartbeat with two stale handles: %v, want a BatchError naming entries 0 and 1", err)
	}
	for i := range 2 {
		if !errors.Is(be.Failed[i], adapters.ErrLeaseLost) {
			t.Errorf("stale entry %d: %v, want an error wrapping ErrLeaseLost", i, be.Failed[i])
		}
	}
	if n := a.Stats().LeaseLost; n != 2 {
		t.Errorf("Stats.LeaseLost = %d, want 2", n)
	}
	if err := a.Ack(e.ctx(), fresh); err != nil {
		t.Errorf("a acks m2: %v", err)
	}
	time.Sleep(2500 * time.Millisecond)
	if got := e.drain(url, 500*time.Millisecond); len(got) != 0 {
		t.Errorf("%d messages came back after being acked", len(got))
	}
	if st := a.Stats(); st.Deleted != 1 {
		t.Errorf("a deleted %d messages, want 1 (m2)", st.Deleted)
	}
}

// TestReceiveOnAnEmptyQueueReturnsEmpty: a Receive whose poll finds the
// queue empty returns an empty result and no error, as documented, rather
// than poll again until messages come: the caller's context must not be
// its only way out.
func TestReceiveOnAnEmptyQueueReturnsEmpty(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ds, err := src.Receive(e.ctx(), 10)
	if err != nil || len(ds) != 0 {
		t.Fatalf("Receive on an empty queue: %d deliveries, %v; want none and no error", len(ds), err)
	}
	if st := src.Stats(); st.EmptyReceives < 1 {
		t.Errorf("Stats.EmptyReceives = %d after an empty poll", st.EmptyReceives)
	}
}
