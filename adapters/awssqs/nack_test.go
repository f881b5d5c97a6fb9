package awssqs

import (
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// TestNacksShareRequestsAndDelayRedelivery: ten workers nacking one message
// each share a ChangeMessageVisibilityBatch request, and the messages stay
// away for the delay asked.
func TestNacksShareRequestsAndDelayRedelivery(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	for range 10 {
		e.send(url, "retry me", "", nil)
	}
	src, err := New(e.ctx(), e.client, url, testOptions(WithNackLinger(200*time.Millisecond))...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ds := receiveAtLeast(t, src, 10)
	before := e.counter.Op("ChangeMessageVisibilityBatch")
	errs := nackEach(e, src, ds, 3*time.Second)
	nacked := time.Now()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("Nack %d: %v", i, err)
		}
	}
	if n := e.counter.Op("ChangeMessageVisibilityBatch") - before; n > 2 {
		t.Errorf("ten concurrent nacks took %d requests, want them to share one (two at most on a slow machine)", n)
	}
	early := e.drain(url, time.Second)
	if len(early) != 0 && time.Since(nacked) < 3*time.Second {
		t.Fatalf("%d nacked messages came back before their 3 s delay", len(early))
	}
	var back int
	waitFor(t, "the nacked messages to come back", func() bool {
		for _, m := range append(e.drain(url, 0), early...) {
			if m.Attributes["ApproximateReceiveCount"] == "2" {
				back++
			}
		}
		early = nil
		return back == 10
	})
}

// TestFullNackBatchGoesOutAtOnce: the linger is for nacks that wait for
// others to fill a ChangeMessageVisibilityBatch; ten fill one, which goes
// out at once. Here the linger is an hour, so the nacks return only if the
// full batch did not wait for it.
func TestFullNackBatchGoesOutAtOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	for range 10 {
		e.send(url, "retry me", "", nil)
	}
	hourLinger := func(o *options) error { o.nackLinger = time.Hour; return nil }
	src, err := New(e.ctx(), e.client, url, testOptions(hourLinger)...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ds := receiveAtLeast(t, src, 10)
	before := e.counter.Op("ChangeMessageVisibilityBatch")
	errs := nackEach(e, src, ds, 0)
	for i, err := range errs {
		if err != nil {
			t.Fatalf("Nack %d: %v (a full batch waited for the linger)", i, err)
		}
	}
	if n := e.counter.Op("ChangeMessageVisibilityBatch") - before; n != 1 {
		t.Errorf("ten nacks took %d requests, want one full batch", n)
	}
	var back int
	waitFor(t, "the ten nacked messages to come back", func() bool {
		back += len(e.drain(url, 0))
		return back == 10
	})
}

// nackEach nacks each delivery in a call of its own, all at once, as the
// runtime's workers do, and returns each call's error.
func nackEach(e *env, src *Source, ds []*adapters.Delivery, delay time.Duration) []error {
	var wg sync.WaitGroup
	errs := make([]error, len(ds))
	for i, d := range ds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = src.Nack(e.ctx(), adapters.NackAll([]*adapters.Delivery{d}, delay))
		}()
	}
	wg.Wait()
	return errs
}
