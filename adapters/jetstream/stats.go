package jetstream

import "sync/atomic"

// Stats are a Source's counters since it was created, an aid for tests and
// benchmarks (in production, read the metrics: see the package
// documentation). JetStream acks one message per request, so the request
// counts divided by Received are the cost per message.
type Stats struct {
	// Fetches counts pull requests; EmptyFetches those that brought
	// nothing; FetchErrors those that failed (and messages without
	// JetStream metadata, which cannot be acked).
	Fetches, EmptyFetches, FetchErrors int64
	// Received counts messages fetched.
	Received int64
	// Acks, Naks, Renewals (InProgress) and Terms count the requests of each
	// kind sent; the Failed counts those not answered (or refused).
	Acks, AcksFailed         int64
	Naks, NaksFailed         int64
	Renewals, RenewalsFailed int64
	Terms, TermsFailed       int64
	// BacklogRequests counts the requests Backlog made (the consumer's
	// info, the stream's lookup, reads of the next message for its age);
	// BacklogRequestsFailed those that failed.
	BacklogRequests, BacklogRequestsFailed int64
	// LeaseLost counts renewals refused because the delivery was last
	// renewed more than AckWait before.
	LeaseLost int64
	// Released counts messages a fetch brought after Receive's context
	// ended or Close was called, given back at once.
	Released int64
	// Pending is the number of messages the consumer has not yet delivered,
	// as of the latest fetch (the backlog).
	Pending int64
}

type counters struct {
	fetches, emptyFetches, fetchErrors, received atomic.Int64
	ops, opsFailed                               [opCount]atomic.Int64
	leaseLost, released, pending                 atomic.Int64
}

func (c *counters) count(op, n, failed int) {
	c.ops[op].Add(int64(n))
	c.opsFailed[op].Add(int64(failed))
}

// Stats returns the Source's counters.
func (s *Source) Stats() Stats {
	c := &s.stats
	return Stats{
		Fetches:               c.fetches.Load(),
		EmptyFetches:          c.emptyFetches.Load(),
		FetchErrors:           c.fetchErrors.Load(),
		Received:              c.received.Load(),
		Acks:                  c.ops[opAck].Load(),
		AcksFailed:            c.opsFailed[opAck].Load(),
		Naks:                  c.ops[opNak].Load(),
		NaksFailed:            c.opsFailed[opNak].Load(),
		Renewals:              c.ops[opProgress].Load(),
		RenewalsFailed:        c.opsFailed[opProgress].Load(),
		Terms:                 c.ops[opTerm].Load(),
		TermsFailed:           c.opsFailed[opTerm].Load(),
		BacklogRequests:       c.ops[opBacklog].Load(),
		BacklogRequestsFailed: c.opsFailed[opBacklog].Load(),
		LeaseLost:             c.leaseLost.Load(),
		Released:              c.released.Load(),
		Pending:               c.pending.Load(),
	}
}
