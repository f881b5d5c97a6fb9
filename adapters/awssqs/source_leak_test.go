package awssqs

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/custody-go/custody/consumer"
)

// sourceGoroutines counts the goroutines running a method of a Source.
func sourceGoroutines() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "adapters/awssqs.(*Source).") {
			n++
		}
	}
	return n
}

// TestUnusedSourceLeavesNoGoroutine: the runtime closes the Source it runs,
// and only that one. A Source that is never run (consumer.New refused an
// option, the service stopped before its consumer started) is closed by no
// one, so it must not have started a goroutine.
//
// Not parallel: the count covers every Source in the test binary, and
// parallel tests wait until the serial ones are done.
func TestUnusedSourceLeavesNoGoroutine(t *testing.T) {
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	before := sourceGoroutines()
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	_, err = consumer.New(src, consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }),
		consumer.WithConcurrency(-1))
	if err == nil {
		t.Fatal("consumer.New accepted WithConcurrency(-1)")
	}
	if n := sourceGoroutines() - before; n != 0 {
		t.Errorf("a Source that was never run left %d goroutines running", n)
	}
}
