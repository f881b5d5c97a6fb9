package consumer

import (
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// callLog records a batcher's calls; each call blocks until released when
// gate is set.
type callLog struct {
	mu      sync.Mutex
	sizes   []int
	running int
	most    int
	gate    chan struct{}
	started chan struct{}
	jobs    int
	done    chan struct{} // closed once jobs entries were sent
	want    int
}

func newCallLog(want int) *callLog {
	return &callLog{started: make(chan struct{}, 1000), done: make(chan struct{}), want: want}
}

func (l *callLog) call(batch []*job) {
	l.mu.Lock()
	l.running++
	l.most = max(l.most, l.running)
	gate := l.gate
	l.mu.Unlock()
	l.started <- struct{}{}
	if gate != nil {
		<-gate
	}
	l.mu.Lock()
	l.running--
	l.sizes = append(l.sizes, len(batch))
	l.jobs += len(batch)
	if l.jobs == l.want {
		close(l.done)
	}
	l.mu.Unlock()
}

func (l *callLog) snapshot() (sizes []int, most int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]int(nil), l.sizes...), l.most
}

func jobs(n int) []*job {
	js := make([]*job, n)
	for i := range js {
		js[i] = &job{}
	}
	return js
}

func waitClosed(t *testing.T, what string, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(30 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// Without a linger, the goroutine that fills a batch sends it, and what
// gathers while a call is under way goes out together when it ends.
func TestBatcherGroupCommits(t *testing.T) {
	l := newCallLog(25)
	l.gate = make(chan struct{})
	b := newBatcher(adapters.Batching{MaxEntries: 10}, l.call)
	js := jobs(25)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); b.addAll(js[:10]) }() // full: this goroutine calls
	waitClosed(t, "the first call", l.started)
	b.addAll(js[10:25]) // gathers behind the call under way
	close(l.gate)
	wg.Wait()
	waitClosed(t, "every entry sent", l.done)
	b.close()
	sizes, most := l.snapshot()
	if most != 1 {
		t.Fatalf("%d calls at once, want 1", most)
	}
	if len(sizes) != 3 || sizes[0] != 10 || sizes[1] != 10 || sizes[2] != 5 {
		t.Fatalf("batch sizes %v, want [10 10 5]: what gathered during the call goes out when it ends, in batches of at most 10", sizes)
	}
}

// A worker about to wait for work sends what is pending; without one, the
// timer does.
func TestBatcherFlushAndTimer(t *testing.T) {
	l := newCallLog(5)
	b := newBatcher(adapters.Batching{MaxEntries: 10}, l.call)
	b.addAll(jobs(3))
	b.flush()
	if sizes, _ := l.snapshot(); len(sizes) != 1 || sizes[0] != 3 {
		t.Fatalf("after flush: calls %v, want one of 3", sizes)
	}
	b.addAll(jobs(2))
	waitClosed(t, "the timer's call", l.done)
	b.close()
}

// With a linger, entries wait for company, calls run on goroutines of the
// batcher's own, no more than MaxCalls at once, and flush leaves them be.
func TestBatcherLingersAndBoundsCalls(t *testing.T) {
	l := newCallLog(45)
	l.gate = make(chan struct{})
	b := newBatcher(adapters.Batching{MaxEntries: 10, Linger: time.Hour, MaxCalls: 2}, l.call)
	b.addAll(jobs(3))
	b.flush()
	select {
	case <-l.started:
		t.Fatal("a partial batch was sent before its linger")
	case <-time.After(20 * time.Millisecond):
	}
	b.addAll(jobs(42)) // 45 in all: four full batches and 5 over
	waitClosed(t, "a call", l.started)
	waitClosed(t, "a second call", l.started)
	select {
	case <-l.started:
		t.Fatal("a third call started while two were under way")
	case <-time.After(20 * time.Millisecond):
	}
	close(l.gate)
	// The 5 left over wait for their linger (an hour); the test ends them
	// by hand, as the run's drain would never need to: they are not due.
	deadline := time.Now().Add(30 * time.Second)
	for {
		sizes, _ := l.snapshot()
		if len(sizes) == 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("calls %v, want four full batches", sizes)
		}
		time.Sleep(time.Millisecond)
	}
	b.mu.Lock()
	b.oldest = time.Now().Add(-time.Hour)
	b.mu.Unlock()
	b.timer.Reset(0)
	waitClosed(t, "the last, lingered batch", l.done)
	b.close()
	sizes, most := l.snapshot()
	if most != 2 {
		t.Fatalf("at most %d calls at once, want 2", most)
	}
	if sizes[4] != 5 {
		t.Fatalf("batch sizes %v, want four of 10 then 5", sizes)
	}
}
