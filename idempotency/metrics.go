package idempotency

import "github.com/custody-go/custody/idempotency/internal/dupmetrics"

// Metric names, for dashboards and alerts. The pgtx helper reports under
// the same names.
const (
	// MetricDuplicates counts duplicates absorbed, by attribute
	// "custody.duplicate.kind": "sequential" (the key was completed: the
	// handler was skipped and the message acked; caused by lost acks,
	// redeliveries after a crash, producers that publish twice) or
	// "overlapping" (the key was in progress elsewhere: the message was
	// retried later; caused by leases that ran out while a handler was
	// still running, rebalances, and consumers that stalled).
	MetricDuplicates = dupmetrics.Duplicates
	// MetricClaimsLost counts claims lost while or after the handler ran,
	// by attribute "custody.idempotency.op" ("extend" or "complete"): the
	// effect may have run, or may run, twice. Lengthen the lease, or look
	// for a store that was unreachable.
	MetricClaimsLost = dupmetrics.ClaimsLost
	// MetricFingerprintMismatches counts messages refused because their key
	// was recorded for another payload.
	MetricFingerprintMismatches = dupmetrics.FingerprintMismatches
	// MetricMissingKeys counts messages refused because they had no key.
	MetricMissingKeys = dupmetrics.MissingKeys
	// MetricStoreErrors counts failed store calls, by attribute
	// "custody.idempotency.op" (claim, complete, release, extend).
	MetricStoreErrors = dupmetrics.StoreErrors
)

const scope = "github.com/custody-go/custody/idempotency"
