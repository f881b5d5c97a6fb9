// Command observability runs a custody consumer on the embedded memory
// broker, with no setup, and serves what an operator watches: OpenTelemetry
// metrics through the Prometheus exporter on /metrics, and the liveness and
// readiness probes on /livez and /readyz. It drives a little traffic that
// fails in the ways docs/operations.md tells apart (retries, a panic, a
// poison message, duplicates sequential and overlapping, a lost ack, a lost
// lease, a dependency outage that trips the kill switch and recovers),
// then prints a summary read from its own /metrics page.
//
//	go run ./examples/observability
//	go run ./examples/observability -duration 5m   # keep serving, to browse the pages
//
// Every counter is on /metrics from the start, at zero, before the first
// message.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"time"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr, nil)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "observability:", err)
		os.Exit(1)
	}
}

// run runs the example with the flags in args: it prints to stdout and
// logs to stderr. watch, when not nil, is called at each phase (before the
// first message, and during the traffic), after run's own report of it.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, watch func(*demo, phase)) error {
	fs := flag.NewFlagSet("observability", flag.ContinueOnError)
	fs.SetOutput(stderr)
	addr := fs.String("addr", "127.0.0.1:9464", "`address` to serve /metrics, /livez and /readyz on (9464: the OpenTelemetry Prometheus exporter's usual port; :0 picks a free one)")
	duration := fs.Duration("duration", 8*time.Second, "how long to run before exiting; the traffic takes about five seconds, and the program exits no sooner than it ends")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *duration < 0 {
		return fmt.Errorf("-duration %v: must not be negative", *duration)
	}
	end := time.Now().Add(*duration)

	d, err := start(*addr, stderr)
	if err != nil {
		return err
	}
	defer d.close()
	fmt.Fprintf(stdout, "custody observability example, consumer %q on the memory broker\n\n", consumerName)
	fmt.Fprintf(stdout, "  metrics    %s/metrics\n", d.base)
	fmt.Fprintf(stdout, "  liveness   %s/livez\n", d.base)
	fmt.Fprintf(stdout, "  readiness  %s/readyz\n\n", d.base)

	at := func(p phase) {
		d.report(ctx, stdout, p)
		if watch != nil {
			watch(d, p)
		}
	}
	// Ready: Run has started (and reported every counter, at zero) and a
	// Receive has returned.
	if err := d.await(ctx, "the consumer to be ready", func() bool { return d.consumer.Status().Ready }); err != nil {
		return err
	}
	at(phaseIdle)
	// An interrupt (ctx) cuts the traffic or the wait short; the summary
	// is printed either way.
	if err := d.traffic(ctx, at); err != nil && ctx.Err() == nil {
		return fmt.Errorf("traffic: %w", err)
	}
	// The backlog gauges are as fresh as their last poll: wait for one
	// after the traffic, for the summary.
	polled := time.Now()
	if err := d.await(ctx, "a backlog poll", func() bool { return d.consumer.Status().BacklogAt.After(polled) }); err != nil && ctx.Err() == nil {
		return err
	}
	if err := sleep(ctx, time.Until(end)); err != nil && ctx.Err() == nil {
		return err
	}

	summaryCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	p, err := scrape(summaryCtx, d.base+"/metrics")
	if err != nil {
		return err
	}
	printSummary(stdout, p)
	orders, twice := d.shop.ledger.counts()
	fmt.Fprintf(stdout, "\n  effects: %d orders applied, %d of them more than once\n", orders, twice)
	if twice > 0 {
		return errors.New("an order's effect was applied twice: the idempotency middleware let a duplicate through")
	}
	return d.close()
}

// report prints what the readiness probe answers at phase p.
func (d *demo) report(ctx context.Context, w io.Writer, p phase) {
	what := map[phase]string{
		phaseIdle:      "before the first message",
		phaseTripped:   "payments down, kill switch tripped",
		phaseRecovered: "payments back, kill switch closed, queue empty",
	}[p]
	code, _, err := d.get(ctx, "/readyz")
	if err != nil {
		fmt.Fprintf(w, "  %-48s /readyz: %v\n", what, err)
		return
	}
	st := d.consumer.Status()
	reason := ""
	if st.Reason != "" {
		reason = " (" + st.Reason + ")"
	}
	fmt.Fprintf(w, "  %-48s /readyz %d%s\n", what, code, reason)
}

// line is one row of the summary: a label and the series it sums.
type line struct {
	label string
	name  string
	attrs []string // label key, value pairs
}

// printSummary prints the consumer's series from a /metrics page.
func printSummary(w io.Writer, p page) {
	consumerLabel := []string{"custody_consumer", consumerName}
	rows := []line{
		{"received", "custody_messages_received_total", nil},
		{"redelivered (attempt > 1)", "custody_messages_redelivered_total", nil},
		{"acked", "custody_messages_settled_total", []string{"custody_outcome", "acked"}},
		{"retried (given back with a delay)", "custody_messages_settled_total", []string{"custody_outcome", "retried"}},
		{"dead-lettered", "custody_messages_settled_total", []string{"custody_outcome", "dead_lettered"}},
		{"lost (settled lost)", "custody_messages_settled_total", []string{"custody_outcome", "lost"}},
		{"handler attempts ok", "custody_handler_duration_seconds_count", []string{"custody_result", "ok"}},
		{"handler attempts failed", "custody_handler_duration_seconds_count", []string{"custody_result", "error"}},
		{"handler attempts deferred", "custody_handler_duration_seconds_count", []string{"custody_result", "deferred"}},
		{"handler attempts unavailable", "custody_handler_duration_seconds_count", []string{"custody_result", "unavailable"}},
		{"handler panics", "custody_handler_panics_total", nil},
		{"dependency unavailable", "custody_handler_unavailable_total", nil},
		{"kill switch trips", "custody_killswitch_trips_total", nil},
		{"lease extensions", "custody_lease_extensions_total", nil},
		{"leases lost", "custody_lease_lost_total", nil},
		{"ack failures", "custody_ack_failures_total", nil},
		{"dead-letter write failures", "custody_deadletter_failures_total", nil},
		{"duplicates sequential (skipped)", "custody_idempotency_duplicates_total", []string{"custody_duplicate_kind", "sequential"}},
		{"duplicates overlapping (deferred)", "custody_idempotency_duplicates_total", []string{"custody_duplicate_kind", "overlapping"}},
		{"backlog waiting (last poll)", "custody_backlog_waiting", nil},
	}
	fmt.Fprintf(w, "\nsummary, read from /metrics (custody_consumer=%q; docs/operations.md says what each tells):\n\n", consumerName)
	for _, r := range rows {
		v, ok := p.sum(r.name, append(consumerLabel, r.attrs...)...)
		series := r.name
		if len(r.attrs) > 0 {
			series += "{" + r.attrs[0] + `="` + r.attrs[1] + `"}`
		}
		value := "-"
		if ok {
			value = strings.TrimSuffix(fmt.Sprintf("%.0f", v), ".0")
		}
		fmt.Fprintf(w, "  %-36s %6s   %s\n", r.label, value, series)
	}
}
