package awssqs

import "sync/atomic"

// Stats are a Source's counters since it was created, for tests and quick
// checks; the same figures go to OpenTelemetry (see WithMeterProvider). SQS
// bills per request, so the request counts are the cost: divide them by
// Received.
type Stats struct {
	// ReceiveRequests counts ReceiveMessage calls; EmptyReceives those that
	// found nothing; ReceiveErrors those that failed.
	ReceiveRequests, EmptyReceives, ReceiveErrors int64
	// Received counts messages received.
	Received int64
	// DeleteRequests counts DeleteMessageBatch calls; Deleted the messages
	// they deleted.
	DeleteRequests, Deleted int64
	// VisibilityRequests counts ChangeMessageVisibilityBatch calls (lease
	// renewals, nacks, releases); VisibilityChanged their successful entries.
	VisibilityRequests, VisibilityChanged int64
	// LeaseLost counts entries SQS refused because the receipt handle was no
	// longer valid: the message's visibility timeout had run out (it was or
	// will be redelivered) or it was already deleted.
	LeaseLost int64
	// Released counts messages received but not handed out, because the
	// Receive that asked for them gave up or the Source was closed, and made
	// visible again.
	Released int64
}

type counters struct {
	receives, emptyReceives, receiveErrors, received atomic.Int64
	deleteRequests, deleted                          atomic.Int64
	visibilityRequests, visibilityChanged            atomic.Int64
	leaseLost, released                              atomic.Int64
}

// Stats returns the Source's counters.
func (s *Source) Stats() Stats {
	c := &s.stats
	return Stats{
		ReceiveRequests:    c.receives.Load(),
		EmptyReceives:      c.emptyReceives.Load(),
		ReceiveErrors:      c.receiveErrors.Load(),
		Received:           c.received.Load(),
		DeleteRequests:     c.deleteRequests.Load(),
		Deleted:            c.deleted.Load(),
		VisibilityRequests: c.visibilityRequests.Load(),
		VisibilityChanged:  c.visibilityChanged.Load(),
		LeaseLost:          c.leaseLost.Load(),
		Released:           c.released.Load(),
	}
}
