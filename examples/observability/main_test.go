package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/consumer"
)

// consumerSeries are the series the consumer reports from the start, at
// zero: every counter (and the in-flight gauge), under the names the
// Prometheus exporter gives them.
var consumerSeries = []struct {
	name  string
	attrs []string
}{
	{"custody_messages_received_total", nil},
	{"custody_messages_redelivered_total", nil},
	{"custody_messages_in_flight", nil},
	{"custody_handler_panics_total", nil},
	{"custody_handler_unavailable_total", nil},
	{"custody_lease_extensions_total", nil},
	{"custody_lease_lost_total", nil},
	{"custody_lease_renewal_failures_total", nil},
	{"custody_ack_failures_total", nil},
	{"custody_deadletter_failures_total", nil},
	{"custody_killswitch_trips_total", nil},
	{"custody_messages_settled_total", []string{"custody_outcome", "acked"}},
	{"custody_messages_settled_total", []string{"custody_outcome", "retried"}},
	{"custody_messages_settled_total", []string{"custody_outcome", "dead_lettered"}},
	{"custody_messages_settled_total", []string{"custody_outcome", "released"}},
	{"custody_messages_settled_total", []string{"custody_outcome", "left"}},
	{"custody_messages_settled_total", []string{"custody_outcome", "lost"}},
	{"custody_messages_settled_total", []string{"custody_outcome", "exhausted"}},
	{"custody_messages_settled_total", []string{"custody_outcome", "failed"}},
}

// TestObservability runs the program as `go run ./examples/observability
// -duration 0` does, and checks what an operator would see: every counter
// on /metrics before the first message, /readyz at 503 while the kill
// switch is tripped and at 200 once it closed, the failures counted under
// their names, and no effect applied twice.
func TestObservability(t *testing.T) {
	var stdout bytes.Buffer
	var logs syncBuffer
	checked := map[phase]bool{}
	watch := func(d *demo, p phase) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		switch p {
		case phaseIdle:
			checkIdle(t, ctx, d)
		case phaseTripped:
			checkTripped(t, ctx, d)
		case phaseRecovered:
			checkRecovered(t, ctx, d)
		}
		checked[p] = true
	}
	err := run(context.Background(), []string{"-addr", "127.0.0.1:0", "-duration", "0"}, &stdout, &logs, watch)
	t.Logf("output:\n%s", stdout.String())
	if err != nil {
		t.Logf("logs:\n%s", logs.String())
		t.Fatal(err)
	}
	for _, p := range []phase{phaseIdle, phaseTripped, phaseRecovered} {
		if !checked[p] {
			t.Errorf("phase %d was never reached", p)
		}
	}
	for _, want := range []string{"/metrics", "/readyz", "custody_messages_received_total", "effects: 72 orders applied, 0 of them more than once"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("output lacks %q", want)
		}
	}
	for _, want := range []string{
		"custody: kill switch tripped: intake stopped; held messages wait without using up attempts",
		"custody: kill switch closed: the probes succeeded; every message runs again",
		"custody: message dead-lettered",
		"custody: lease lost; expect a redelivery",
		"custody: ack failed; expect a redelivery",
	} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("logs lack %q", want)
		}
	}
}

// checkIdle: nothing is published yet, and /metrics lists every counter
// of the consumer, at zero.
func checkIdle(t *testing.T, ctx context.Context, d *demo) {
	t.Helper()
	if st, err := d.broker.Stats(queue); err != nil || st.Received != 0 {
		t.Fatalf("before the traffic the broker reports %+v, %v; want nothing received", st, err)
	}
	p, err := scrape(ctx, d.base+"/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range consumerSeries {
		v, ok := p.sum(s.name, append([]string{"custody_consumer", consumerName}, s.attrs...)...)
		switch {
		case !ok:
			t.Errorf("before the first message, /metrics lacks %s%v", s.name, s.attrs)
		case v != 0:
			t.Errorf("before the first message, %s%v = %v, want 0", s.name, s.attrs, v)
		}
	}
}

// checkTripped: the kill switch is open (or half-open, probing) while the
// payment service is down: not ready, still live.
func checkTripped(t *testing.T, ctx context.Context, d *demo) {
	t.Helper()
	code, body, err := d.get(ctx, "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	var st consumer.Status
	if err := json.Unmarshal(body, &st); err != nil {
		t.Fatalf("/readyz body %q: %v", body, err)
	}
	if code != http.StatusServiceUnavailable || st.Ready || (st.KillSwitch != "open" && st.KillSwitch != "half-open") {
		t.Errorf("/readyz with the kill switch tripped: %d %s; want 503, kill switch open", code, body)
	}
	if code, body, err := d.get(ctx, "/livez"); err != nil || code != http.StatusOK {
		t.Errorf("/livez with the kill switch tripped: %d %s %v; want 200: a paused consumer is live", code, body, err)
	}
}

// checkRecovered: ready again, every failure counted under its name, only
// the poison message dead-lettered, every order applied once.
func checkRecovered(t *testing.T, ctx context.Context, d *demo) {
	t.Helper()
	if code, body, err := d.get(ctx, "/readyz"); err != nil || code != http.StatusOK {
		t.Errorf("/readyz after the recovery: %d %s %v; want 200", code, body, err)
	}
	p, err := scrape(ctx, d.base+"/metrics")
	if err != nil {
		t.Fatal(err)
	}
	get := func(name string, attrs ...string) float64 {
		v, _ := p.sum(name, append([]string{"custody_consumer", consumerName}, attrs...)...)
		return v
	}
	atLeast := func(name string, min float64, attrs ...string) {
		t.Helper()
		if v := get(name, attrs...); v < min {
			t.Errorf("%s%v = %v, want at least %v", name, attrs, v, min)
		}
	}
	exactly := func(name string, want float64, attrs ...string) {
		t.Helper()
		if v := get(name, attrs...); v != want {
			t.Errorf("%s%v = %v, want %v", name, attrs, v, want)
		}
	}
	exactly("custody_messages_settled_total", 1, "custody_outcome", "dead_lettered")
	exactly("custody_handler_panics_total", 1)
	exactly("custody_lease_lost_total", 1)
	atLeast("custody_ack_failures_total", 1)
	atLeast("custody_messages_settled_total", 5, "custody_outcome", "retried") // the flaky orders
	atLeast("custody_messages_redelivered_total", 5)
	atLeast("custody_lease_extensions_total", 1) // the slow order's duplicates, the waits of the outage
	atLeast("custody_handler_unavailable_total", 1)
	atLeast("custody_killswitch_trips_total", 1)
	// Order 5 published twice, the lost ack's redelivery, and the lost
	// lease's last redelivery; the lost lease's redeliveries while it ran
	// overlapped it.
	exactly("custody_idempotency_duplicates_total", 3, "custody_duplicate_kind", "sequential")
	atLeast("custody_idempotency_duplicates_total", 1, "custody_duplicate_kind", "overlapping")

	dead, err := d.broker.Messages(deadLetters)
	if err != nil || len(dead) != 1 || dead[0].ID != "order-poison" {
		t.Errorf("dead-letter queue holds %v (%v); want only the poison message: the outage dead-letters nothing", dead, err)
	}
	if orders, twice := d.shop.ledger.counts(); orders != 72 || twice != 0 {
		t.Errorf("%d orders applied, %d more than once; want 72, none twice", orders, twice)
	}
}

// syncBuffer is a bytes.Buffer the consumer's goroutines may log into.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
