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
	var wg sync.WaitGroup
	errs := make([]error, len(ds))
	for i, d := range ds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = src.Nack(e.ctx(), []*adapters.Delivery{d}, 3*time.Second)
		}()
	}
	wg.Wait()
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
