package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/attribute"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
)

// The names the example gives its consumer and queues. The consumer's name
// is the custody_consumer label of every metric it reports.
const (
	consumerName = "orders"
	queue        = "orders"
	deadLetters  = "orders-dlq"
	lease        = 500 * time.Millisecond // the broker redelivers after this unless the lease is renewed
)

// demo is the running example: a memory broker, a consumer with the
// idempotency middleware and a kill switch, and an HTTP server for its
// metrics and probes.
type demo struct {
	broker   *memory.Broker
	consumer *consumer.Consumer
	provider *sdkmetric.MeterProvider
	server   *http.Server
	base     string // http://host:port
	shop     *shop

	stop      context.CancelFunc // ends Run
	runDone   chan error         // Run's result
	serveDone chan error         // Serve's result

	closeOnce sync.Once
	closeErr  error
}

// start builds the example and starts its consumer and its HTTP server on
// addr. Nothing is published yet: the traffic is sent by (*demo).traffic.
// logs receives the consumer's log lines (WARN and above).
func start(addr string, logs io.Writer) (*demo, error) {
	// The OpenTelemetry SDK reads the instruments; the Prometheus exporter
	// turns each collection into a Prometheus scrape. A registry of our
	// own, rather than the global one, so that two demos in one test
	// process do not collide.
	registry := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(registry))
	if err != nil {
		return nil, fmt.Errorf("prometheus exporter: %w", err)
	}
	provider := sdkmetric.NewMeterProvider(
		sdkmetric.WithReader(exporter),
		sdkmetric.WithResource(resource.NewSchemaless(attribute.String("service.name", "custody-observability-example"))),
	)
	d := &demo{provider: provider, runDone: make(chan error, 1), serveDone: make(chan error, 1)}
	if err := d.build(logs); err != nil {
		_ = provider.Shutdown(context.Background())
		return nil, err
	}

	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{}))
	mux.Handle("GET /livez", d.consumer.LiveHandler())
	mux.Handle("GET /readyz", d.consumer.ReadyHandler())
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		_ = provider.Shutdown(context.Background())
		return nil, fmt.Errorf("listening on %s (pass another -addr): %w", addr, err)
	}
	d.base = "http://" + ln.Addr().String()
	d.server = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { d.serveDone <- d.server.Serve(ln) }()

	ctx, stop := context.WithCancel(context.Background())
	d.stop = stop
	go func() { d.runDone <- d.consumer.Run(ctx) }()
	return d, nil
}

// build makes the broker, its queues and the consumer.
func (d *demo) build(logs io.Writer) error {
	d.broker = memory.NewBroker()
	if err := d.broker.CreateQueue(deadLetters, memory.QueueOptions{}); err != nil {
		return err
	}
	if err := d.broker.CreateQueue(queue, memory.QueueOptions{Lease: lease}); err != nil {
		return err
	}
	d.shop = newShop()
	src, err := d.broker.Source(queue, memory.WithPollWait(100*time.Millisecond), memory.WithFaults(d.shop.faults()))
	if err != nil {
		return err
	}
	dlq, err := d.broker.DeadLetterQueue(deadLetters)
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))

	store, err := idempotency.NewMemoryStore()
	if err != nil {
		return err
	}
	dedup, err := idempotency.New(store,
		// The producer's order id, not the broker's message id: it also
		// catches an order published twice.
		idempotency.WithKeyFunc(func(m *consumer.Message) string { return m.Headers["order-id"] }),
		idempotency.WithName(consumerName), // joins its metrics to the consumer's
		idempotency.WithMeterProvider(d.provider),
		idempotency.WithOverlapRetryDelay(400*time.Millisecond),
		idempotency.WithLogger(logger),
	)
	if err != nil {
		return err
	}

	d.consumer, err = consumer.New(src, consumer.Chain(consumer.HandlerFunc(d.shop.handle), dedup),
		consumer.WithName(consumerName),
		consumer.WithConcurrency(8),
		consumer.WithRetry(consumer.Retry{
			MaxAttempts: 4,
			Backoff:     consumer.ExponentialBackoff{Initial: 50 * time.Millisecond, Max: 500 * time.Millisecond, Multiplier: 2, Jitter: 0.2},
		}),
		consumer.WithDeadLetter(dlq),
		// Short windows so that the demo's outage trips the switch and
		// recovers within seconds; production values are the defaults'
		// order: a 30 s window, a 30 s cooldown.
		consumer.WithKillSwitch(consumer.KillSwitch{
			Window:      2 * time.Second,
			MinAttempts: 10,
			Ratio:       0.5,
			Cooldown:    time.Second,
			Probes:      3,
		}),
		consumer.WithBacklogInterval(time.Second),
		consumer.WithMeterProvider(d.provider),
		consumer.WithLogger(logger),
	)
	return err
}

// close stops the consumer (it drains), then the HTTP server and the meter
// provider. Calls after the first return the first's result.
func (d *demo) close() error {
	d.closeOnce.Do(func() { d.closeErr = d.shutdown() })
	return d.closeErr
}

func (d *demo) shutdown() error {
	d.stop()
	runErr := <-d.runDone
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	shutErr := d.server.Shutdown(ctx)
	if err := <-d.serveDone; !errors.Is(err, http.ErrServerClosed) {
		shutErr = errors.Join(shutErr, err)
	}
	return errors.Join(runErr, shutErr, d.provider.Shutdown(ctx))
}

// get fetches path from the demo's server and returns the status code and
// body.
func (d *demo) get(ctx context.Context, path string) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, d.base+path, nil)
	if err != nil {
		return 0, nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, body, err
}

// ledger counts the effects applied per order: the outcome a user sees.
type ledger struct {
	mu      sync.Mutex
	applied map[string]int
}

func (l *ledger) apply(id string) {
	l.mu.Lock()
	l.applied[id]++
	l.mu.Unlock()
}

// counts returns how many orders were applied, and how many more than once.
func (l *ledger) counts() (orders, twice int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, n := range l.applied {
		if n > 1 {
			twice++
		}
	}
	return len(l.applied), twice
}
