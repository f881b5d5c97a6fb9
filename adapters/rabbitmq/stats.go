package rabbitmq

import "sync/atomic"

// counters is the live, atomic form of Stats.
type counters struct {
	generations, delivered, ackFrames, multipleAcks, acked, ackErrors,
	rejects, droppedAcks, lost, delayQueued, retriedAtOnce, retryFailures atomic.Uint64
}

// Stats are counters over the life of a Source, for tests, benchmarks and
// metrics.
type Stats struct {
	// Generations counts channels consumed from: 1 plus the reconnections.
	Generations uint64
	// Delivered counts deliveries received from the broker.
	Delivered uint64
	// AckFrames counts basic.ack frames sent; MultipleAcks of them had
	// multiple=true. Acked counts the deliveries they acked.
	AckFrames, MultipleAcks, Acked uint64
	// AckErrors counts acks the client failed to write (the channel was
	// closing); their messages come back.
	AckErrors uint64
	// Rejects counts basic.nack frames (requeues and native dead letters).
	Rejects uint64
	// DroppedAcks counts acks not sent because their channel died first;
	// the broker redelivers those messages.
	DroppedAcks uint64
	// Lost counts deliveries lost to a dead channel or to Close.
	Lost uint64
	// DelayQueued counts retries whose copy went through a delay queue.
	// RetryFailures counts retries whose copy the delay queue did not take;
	// RetriedAtOnce counts those whose copy went to the queue at once
	// instead (the others were requeued).
	DelayQueued, RetryFailures, RetriedAtOnce uint64
}

// Stats returns the Source's counters.
func (s *Source) Stats() Stats {
	c := &s.stats
	return Stats{
		Generations: c.generations.Load(), Delivered: c.delivered.Load(),
		AckFrames: c.ackFrames.Load(), MultipleAcks: c.multipleAcks.Load(), Acked: c.acked.Load(),
		AckErrors: c.ackErrors.Load(), Rejects: c.rejects.Load(), DroppedAcks: c.droppedAcks.Load(),
		Lost: c.lost.Load(), DelayQueued: c.delayQueued.Load(), RetryFailures: c.retryFailures.Load(),
		RetriedAtOnce: c.retriedAtOnce.Load(),
	}
}
