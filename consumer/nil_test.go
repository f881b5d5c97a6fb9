package consumer_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// pointerHandler is a Handler with state, made by a constructor that can
// fail.
type pointerHandler struct{ calls int }

func (h *pointerHandler) Handle(context.Context, *consumer.Message) error {
	h.calls++
	return nil
}

func okHandler() consumer.HandlerFunc {
	return func(context.Context, *consumer.Message) error { return nil }
}

func passThrough(h consumer.Handler) consumer.Handler { return h }

// The nil values an unchecked constructor error leaves behind fail New with
// an error that says what is wrong and what to do, rather than panicking in
// New or in every handler call (which would dead-letter every message).
func TestNilTrapsFailAtNew(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{})
	failedSrc, err := e.b.Source("no-such-queue") // a typed nil *memory.Source
	if err == nil {
		t.Fatal("Source of a missing queue succeeded")
	}
	var nilMiddleware consumer.Middleware // a constructor's nil, as idempotency.New returns with its error
	cases := []struct {
		name string
		new  func() (*consumer.Consumer, error)
		want []string
	}{
		{"typed nil Source", func() (*consumer.Consumer, error) { return consumer.New(failedSrc, okHandler()) },
			[]string{"nil *memory.Source", "check the error"}},
		{"nil HandlerFunc", func() (*consumer.Consumer, error) { return consumer.New(e.source(), consumer.HandlerFunc(nil)) },
			[]string{"nil HandlerFunc", "pass the function"}},
		{"nil Handler", func() (*consumer.Consumer, error) { return consumer.New(e.source(), nil) },
			[]string{"nil Handler", "HandlerFunc adapts a function"}},
		{"typed nil Handler", func() (*consumer.Consumer, error) {
			var h *pointerHandler
			return consumer.New(e.source(), h)
		}, []string{"nil *consumer_test.pointerHandler", "check the error"}},
		{"nil Middleware", func() (*consumer.Consumer, error) {
			return consumer.New(e.source(), consumer.Chain(okHandler(), passThrough, nilMiddleware))
		}, []string{"consumer.Chain", "middleware 1 of 2 is nil", "check the error"}},
		{"Middleware returning nil", func() (*consumer.Consumer, error) {
			return consumer.New(e.source(), consumer.Chain(okHandler(), func(consumer.Handler) consumer.Handler { return nil }))
		}, []string{"consumer.Chain", "middleware 0 of 1 returned a nil Handler"}},
		{"nil Handler in Chain", func() (*consumer.Consumer, error) {
			return consumer.New(e.source(), consumer.Chain(consumer.HandlerFunc(nil), passThrough))
		}, []string{"consumer.Chain", "Handler is nil"}},
		{"nil Middleware in an inner Chain", func() (*consumer.Consumer, error) {
			return consumer.New(e.source(), consumer.Chain(consumer.Chain(okHandler(), nilMiddleware), passThrough))
		}, []string{"middleware 0 of 1 is nil"}},
		{"typed nil MeterProvider", func() (*consumer.Consumer, error) {
			return consumer.New(e.source(), okHandler(), consumer.WithMeterProvider((*sdkmetric.MeterProvider)(nil)))
		}, []string{"WithMeterProvider", "nil *metric.MeterProvider"}},
		{"typed nil TracerProvider", func() (*consumer.Consumer, error) {
			return consumer.New(e.source(), okHandler(), consumer.WithTracerProvider((*sdktrace.TracerProvider)(nil)))
		}, []string{"WithTracerProvider", "nil *trace.TracerProvider"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var c *consumer.Consumer
			var err error
			func() {
				defer func() {
					if p := recover(); p != nil {
						t.Fatalf("New panicked: %v", p)
					}
				}()
				c, err = tc.new()
			}()
			if err == nil {
				t.Fatalf("New accepted it (%v)", c)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("New error %q does not say %q", err, w)
				}
			}
		})
	}
}

// A Chain with a nil Middleware that another wrapper hides from New fails
// every attempt as Unavailable, saying why: its messages wait instead of
// being dead-lettered for the wiring mistake.
func TestBrokenChainHiddenFromNewIsUnavailable(t *testing.T) {
	var nilMiddleware consumer.Middleware
	broken := consumer.Chain(okHandler(), nilMiddleware)
	hidden := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return broken.Handle(ctx, m)
	})
	var err error
	func() {
		defer func() {
			if p := recover(); p != nil {
				t.Fatalf("the chained handler panicked: %v", p)
			}
		}()
		err = hidden.Handle(context.Background(), &consumer.Message{ID: "m"})
	}()
	if !consumer.IsUnavailable(err) || !strings.Contains(err.Error(), "middleware 0 of 1 is nil") {
		t.Fatalf("Handle = %v, want an Unavailable error naming the nil middleware", err)
	}
	if consumer.IsPermanent(err) || errors.Is(err, context.Canceled) {
		t.Fatalf("Handle = %v", err)
	}
}

// Chain is unchanged for what is not nil: middleware order, and a pointer
// handler with its state.
func TestChainOfValidHandlersRuns(t *testing.T) {
	h := &pointerHandler{}
	var order []string
	mw := func(name string) consumer.Middleware {
		return func(next consumer.Handler) consumer.Handler {
			return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				order = append(order, name)
				return next.Handle(ctx, m)
			})
		}
	}
	if err := consumer.Chain(h, mw("outer"), mw("inner")).Handle(context.Background(), &consumer.Message{}); err != nil {
		t.Fatal(err)
	}
	if h.calls != 1 || strings.Join(order, ",") != "outer,inner" {
		t.Fatalf("calls %d, order %v", h.calls, order)
	}
}
