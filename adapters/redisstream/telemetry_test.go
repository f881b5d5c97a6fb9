package redisstream

import (
	"context"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// collect returns every metric the reader holds, by name.
func collect(t *testing.T, r *sdkmetric.ManualReader) map[string]metricdata.Aggregation {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := map[string]metricdata.Aggregation{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			out[m.Name] = m.Data
		}
	}
	return out
}

func gauge(t *testing.T, a metricdata.Aggregation) (int64, bool) {
	t.Helper()
	g, ok := a.(metricdata.Gauge[int64])
	if !ok || len(g.DataPoints) != 1 {
		return 0, false
	}
	return g.DataPoints[0].Value, true
}

// sumBy returns the counter's total for data points whose attribute key has
// value val (all of them when key is empty).
func sumBy(a metricdata.Aggregation, key, val string) int64 {
	s, ok := a.(metricdata.Sum[int64])
	if !ok {
		return 0
	}
	var n int64
	for _, dp := range s.DataPoints {
		if v, ok := dp.Attributes.Value(attribute.Key(key)); key == "" || ok && v.AsString() == val {
			n += dp.Value
		}
	}
	return n
}

// TestBacklogMetrics holds two entries and leaves three unread: the pending
// gauge must say 2 and the lag 3, and the command counter must count what
// was sent.
func TestBacklogMetrics(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	e := newEnv(t)
	e.publish("a", "b", "c", "d", "e", "f")
	src := e.open(WithMeterProvider(mp), WithLease(time.Second))
	defer src.Close()
	ds := receiveN(t, src, 3)
	if err := src.Ack(e.ctx(), ds[:1]); err != nil {
		t.Fatal(err)
	}
	m := collect(t, reader)
	if n, ok := gauge(t, m["custody.redis.pending"]); !ok || n != 2 {
		t.Errorf("custody.redis.pending = %d (reported %t), want 2", n, ok)
	}
	if n, ok := gauge(t, m["custody.redis.lag"]); !ok || n != 3 {
		t.Errorf("custody.redis.lag = %d (reported %t), want 3", n, ok)
	}
	cmds := m["custody.redis.commands"]
	if n := sumBy(cmds, "custody.redis.command", "xack"); n != 1 {
		t.Errorf("custody.redis.commands{xack} = %d, want 1", n)
	}
	if n := sumBy(cmds, "custody.redis.command", "xreadgroup"); n < 1 {
		t.Errorf("custody.redis.commands{xreadgroup} = %d, want at least 1", n)
	}
	if n := sumBy(cmds, "", ""); n != src.Stats().Commands() {
		t.Errorf("custody.redis.commands counts %d, Stats %d", n, src.Stats().Commands())
	}
}
