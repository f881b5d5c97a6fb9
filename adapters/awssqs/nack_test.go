package awssqs

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// TestNackDelaysEachEntry: one Nack call of ten entries is one
// ChangeMessageVisibilityBatch request, and each message stays away for its
// own entry's delay: the five given no delay come back at once, the five
// given an hour do not.
func TestNackDelaysEachEntry(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	for i := range 10 {
		e.send(url, fmt.Sprint(i), "", nil)
	}
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ds := receiveAtLeast(t, src, 10)
	ns := make([]adapters.Nack, len(ds))
	now := map[string]bool{}
	for i, d := range ds {
		ns[i] = adapters.Nack{Delivery: d}
		if i%2 == 0 {
			ns[i].After = time.Hour
		} else {
			now[string(d.Body)] = true
		}
	}
	before := e.counter.Op("ChangeMessageVisibilityBatch")
	if err := src.Nack(e.ctx(), ns); err != nil {
		t.Fatalf("Nack: %v", err)
	}
	if n := e.counter.Op("ChangeMessageVisibilityBatch") - before; n != 1 {
		t.Errorf("a Nack of ten entries took %d requests, want 1", n)
	}
	back := map[string]bool{}
	for _, m := range e.drain(url, 2*time.Second) {
		back[aws.ToString(m.Body)] = true
	}
	for b := range now {
		if !back[b] {
			t.Errorf("message %s, nacked with no delay, did not come back at once", b)
		}
	}
	for b := range back {
		if !now[b] {
			t.Errorf("message %s, nacked for an hour, came back at once", b)
		}
	}
}

// TestRuntimeBatchesNacks: the Source declares a nack linger, so the runtime
// gathers the nacks of handlers failing one after another into a shared
// ChangeMessageVisibilityBatch request, rather than sending one request per
// failure.
func TestRuntimeBatchesNacks(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	const n = 10
	for i := range n {
		e.send(url, strconv.Itoa(i), "", nil)
	}
	src, err := New(e.ctx(), e.client, url, testOptions(WithNackLinger(time.Second))...)
	if err != nil {
		t.Fatal(err)
	}
	var failed, done atomic.Int32
	var nackRequests int64
	runUntil(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if m.Attempt > 1 {
			done.Add(1)
			return nil
		}
		// One failure every 10 ms or so.
		i, _ := strconv.Atoi(string(m.Body))
		time.Sleep(time.Duration(i%n) * 10 * time.Millisecond)
		failed.Add(1)
		return fmt.Errorf("failure %d", i)
	}), "every message failed once, then handled", func() bool {
		if done.Load() < n {
			return false
		}
		// Before the shutdown, which gives back what it holds: the
		// visibility changes so far are the nacks (no renewal is due
		// within the 30 s timeout).
		nackRequests = e.counter.Op("ChangeMessageVisibilityBatch")
		return true
	}, consumer.WithConcurrency(n), fastRetry(3))
	if nackRequests > 2 {
		t.Errorf("%d nacks took %d ChangeMessageVisibilityBatch requests, want them to share one (two at most on a slow machine)", failed.Load(), nackRequests)
	}
}
