// Package dupmetrics holds the OpenTelemetry counters the idempotency
// middleware and the pgtx helper share, so both report duplicates under the
// same names.
package dupmetrics

import (
	"slices"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Metric names; idempotency re-exports and documents them.
const (
	Duplicates            = "custody.idempotency.duplicates"
	ClaimsLost            = "custody.idempotency.claims_lost"
	FingerprintMismatches = "custody.idempotency.fingerprint_mismatches"
	MissingKeys           = "custody.idempotency.missing_keys"
	StoreErrors           = "custody.idempotency.store_errors"
)

// Set is the counters with their attribute sets computed once, so counting
// allocates nothing.
type Set struct {
	Duplicates, ClaimsLost, Mismatches, MissingKeys, StoreErrors metric.Int64Counter

	// Plain is for the counters that take no attribute of their own: it
	// carries only the consumer's name, if any.
	Plain                                    metric.AddOption
	Sequential, Overlapping                  metric.AddOption
	OpClaim, OpComplete, OpRelease, OpExtend metric.AddOption
}

// New creates the counters in the meter scope. A consumer name, when not
// empty, is added to every data point as custody.consumer, the attribute
// the runtime's own metrics carry, so that the two join.
func New(mp metric.MeterProvider, scope, consumer string) (*Set, error) {
	m := mp.Meter(scope)
	var (
		s   Set
		err error
	)
	counter := func(name, desc string) metric.Int64Counter {
		if err != nil {
			return nil
		}
		var c metric.Int64Counter
		c, err = m.Int64Counter(name, metric.WithDescription(desc), metric.WithUnit("{message}"))
		return c
	}
	s.Duplicates = counter(Duplicates, "Duplicate deliveries absorbed, by kind: sequential (skipped and acked) or overlapping (retried later).")
	s.ClaimsLost = counter(ClaimsLost, "Claims lost while or after the handler ran; the effect may run twice.")
	s.Mismatches = counter(FingerprintMismatches, "Messages whose key was recorded for a different payload.")
	s.MissingKeys = counter(MissingKeys, "Messages refused because they had no idempotency key.")
	s.StoreErrors = counter(StoreErrors, "Failed idempotency store calls, by operation.")
	if err != nil {
		return nil, err
	}
	var base []attribute.KeyValue
	if consumer != "" {
		base = append(base, attribute.String("custody.consumer", consumer))
	}
	set := func(k, v string) metric.AddOption {
		kvs := append(slices.Clone(base), attribute.String(k, v))
		return metric.WithAttributeSet(attribute.NewSet(kvs...))
	}
	s.Plain = metric.WithAttributeSet(attribute.NewSet(base...))
	s.Sequential = set("custody.duplicate.kind", "sequential")
	s.Overlapping = set("custody.duplicate.kind", "overlapping")
	s.OpClaim = set("custody.idempotency.op", "claim")
	s.OpComplete = set("custody.idempotency.op", "complete")
	s.OpRelease = set("custody.idempotency.op", "release")
	s.OpExtend = set("custody.idempotency.op", "extend")
	return &s, nil
}
