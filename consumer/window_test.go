package consumer

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
)

func TestDefaultWindowMakesRoomForLingeringAcks(t *testing.T) {
	cases := []struct {
		name        string
		concurrency int
		caps        adapters.Capabilities
		want        int
	}{
		{"in-process acks", 1, adapters.Capabilities{}, 20},
		{"many workers", 16, adapters.Capabilities{}, 32},
		{"acks waiting for a batch (SQS)", 8, adapters.Capabilities{Ack: adapters.Batching{MaxEntries: 10, Linger: 20 * time.Millisecond, MaxCalls: 4}}, 60},
		{"capped by the prefetch", 4, adapters.Capabilities{MaxUnacked: 8, Ack: adapters.Batching{MaxEntries: 10, Linger: time.Millisecond}}, 8},
	}
	for _, c := range cases {
		if got := defaultMaxInFlight(c.concurrency, c.caps); got != c.want {
			t.Errorf("%s: window %d, want %d", c.name, got, c.want)
		}
	}
}

// prefetchSource is a memory source with a prefetch.
type prefetchSource struct{ *memory.Source }

func (s prefetchSource) Capabilities() adapters.Capabilities {
	c := s.Source.Capabilities()
	c.MaxUnacked = 10
	return c
}

func TestWindowAboveMaxUnackedFailsAtNew(t *testing.T) {
	b := memory.NewBroker()
	if err := b.CreateQueue("q", memory.QueueOptions{}); err != nil {
		t.Fatal(err)
	}
	src, err := b.Source("q")
	if err != nil {
		t.Fatal(err)
	}
	h := HandlerFunc(func(context.Context, *Message) error { return nil })
	_, err = New(prefetchSource{src}, h, WithMaxInFlight(11))
	if err == nil || !strings.Contains(err.Error(), "WithMaxInFlight(11)") {
		t.Fatalf("New with a window above the prefetch: %v, want an error naming WithMaxInFlight", err)
	}
	if _, err := New(prefetchSource{src}, h, WithMaxInFlight(10)); err != nil {
		t.Fatalf("New with a window at the prefetch: %v", err)
	}
}
