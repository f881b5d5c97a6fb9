package consumer

import (
	"testing"

	metricnoop "go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/trace/noop"
)

// The switches are off for the no-op providers and on for an SDK; the
// global providers' cases are covered end to end in telemetry_test.go.
func TestTelemetrySwitches(t *testing.T) {
	if newMetricSwitch(metricnoop.NewMeterProvider())() {
		t.Error("handler durations timed for the no-op meter provider")
	}
	if !newMetricSwitch(sdkmetric.NewMeterProvider())() {
		t.Error("handler durations not timed for an SDK meter provider")
	}
	if newSpanSwitch(noop.NewTracerProvider())() {
		t.Error("spans started for the no-op tracer provider")
	}
}
