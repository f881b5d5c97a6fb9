package kafka

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Receive implements adapters.Source: it hands out polled records, up to the
// unacked bounds, waiting at most the poll wait for new ones. A
// partition's fetch error (a data loss, a topic not authorised) is returned
// along with the records of the other partitions. Concurrent calls poll one
// at a time.
func (s *Source) Receive(ctx context.Context, want int) ([]*adapters.Delivery, error) {
	if want < 1 {
		want = 1
	}
	s.mu.Lock()
	if s.closed || s.closing {
		s.mu.Unlock()
		return nil, adapters.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		// Handed out now, backlog records would start handlers after the
		// runtime began to shut down.
		s.mu.Unlock()
		return nil, err
	}
	s.setLaneCapLocked(want)
	out := s.takeLocked(nil, want)
	room := s.cfg.maxTotal - s.totalHeld
	s.mu.Unlock()
	if len(out) > 0 {
		return out, nil
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if room <= 0 {
		return s.waitForRoom(ctx, want)
	}
	return s.poll(ctx, want)
}

// waitForRoom waits, up to the poll wait, for acks to free capacity.
func (s *Source) waitForRoom(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	t := time.NewTimer(s.cfg.pollWait)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-t.C:
	case <-s.wake:
	}
	s.mu.Lock()
	out := s.takeLocked(nil, max)
	s.mu.Unlock()
	return out, nil
}

// poll takes every record the client has fetched, waiting up to the poll
// wait for some, into the partitions' backlogs, and hands out up to max.
// Every record, not n: see the package documentation, section Backpressure.
func (s *Source) poll(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	var out []*adapters.Delivery
	select {
	case s.pollSem <- struct{}{}:
	default:
		// Another Receive is polling (see pollSem): wait for it, then hand
		// out what it booked before polling again.
		select {
		case s.pollSem <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		s.mu.Lock()
		out = s.takeLocked(nil, max)
		s.mu.Unlock()
		if len(out) > 0 {
			<-s.pollSem
			return out, nil
		}
	}
	defer func() { <-s.pollSem }()
	pctx, cancel := context.WithTimeout(ctx, s.cfg.pollWait)
	s.mu.Lock()
	s.pollCancel = cancel
	s.mu.Unlock()
	fs := s.cl.PollRecords(pctx, 0)
	s.mu.Lock()
	s.pollCancel = nil
	refetch, lose, notices := s.registerLocked(fs)
	out = s.takeLocked(nil, max)
	s.mu.Unlock()
	cancel()
	for _, h := range lose {
		h.sig.Lose(ErrRewound)
	}
	if len(refetch) > 0 {
		// Before AllowRebalance, as franz-go asks: no revoke runs meanwhile.
		s.cl.SetOffsets(refetch)
	}
	// The records are booked under their epoch: a rebalance may proceed.
	s.cl.AllowRebalance()
	ferr := errors.Join(fetchError(fs), notices)
	if len(out) > 0 {
		return out, ferr // a partition's error must not hide behind others' records
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if fs.IsClientClosed() {
		return nil, adapters.ErrClosed
	}
	return nil, ferr
}

// fetchError returns the first error of fs that is not a poll's own context
// ending, or nil.
func fetchError(fs kgo.Fetches) error {
	var ferr error
	fs.EachError(func(topic string, part int32, err error) {
		if ferr == nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, kgo.ErrClientClosed) {
			ferr = fmt.Errorf("kafka: fetching %s/%d: %w", topic, part, err)
		}
	})
	return ferr
}

// hasRecords reports whether fs holds records of topic/part.
func hasRecords(fs kgo.Fetches, topic string, part int32) bool {
	found := false
	fs.EachPartition(func(fp kgo.FetchTopicPartition) {
		found = found || (fp.Topic == topic && fp.Partition == part && len(fp.Records) > 0)
	})
	return found
}

// registerLocked appends polled records to their partitions' backlogs.
// Records of partitions no longer assigned (or assigned anew since the fetch)
// are dropped: their current owner reads them from the committed offset.
// It returns, for partitions rewound after a data loss (see rewindLocked),
// the offsets to fetch again from (for SetOffsets) and the records in
// flight to lose outside the lock; and the records deleted before the group
// read them (see expiredLocked), for Receive to report.
func (s *Source) registerLocked(fs kgo.Fetches) (refetch map[string]map[int32]kgo.EpochOffset, lose []*held, notices error) {
	// Data losses first. franz-go appends its data-loss notices after a
	// poll's records, and fetches from the rewind point at once: a late poll
	// (the runtime busy, the unacked bound reached) holds records read from
	// the rewind point before the notice. Registered first, those would pass
	// for records already polled and be dropped (never to be fetched again),
	// or move lastPolled past the reset point and fake a rewind below them.
	fs.EachError(func(topic string, part int32, err error) {
		var loss *kgo.ErrDataLoss
		if !errors.As(err, &loss) {
			return
		}
		p := s.parts[tpKey{topic, part}]
		if _, again := refetch[topic][part]; p == nil || p.fenced || p.draining || again || loss.ResetTo > p.lastPolled {
			return
		}
		var from int64
		p, from, lose = s.rewindLocked(p, loss.ResetTo, lose)
		if from < loss.ResetTo || hasRecords(fs, topic, part) {
			// Records between from and the reset point were polled but
			// not all done, or this poll holds records of the partition
			// that may be the old log's as well as the new one's (fetched
			// before the rewind, and buffered): fetch from from again, in
			// the new log's order, and ignore what this poll holds.
			if refetch == nil {
				refetch = map[string]map[int32]kgo.EpochOffset{}
			}
			if refetch[topic] == nil {
				refetch[topic] = map[int32]kgo.EpochOffset{}
			}
			refetch[topic][part] = kgo.EpochOffset{Epoch: -1, Offset: from}
		}
		s.updatePauseLocked(p) // the old epoch may have been paused
	})
	fs.EachPartition(func(fp kgo.FetchTopicPartition) {
		p := s.parts[tpKey{fp.Topic, fp.Partition}]
		if _, again := refetch[fp.Topic][fp.Partition]; p == nil || p.fenced || p.draining || again {
			return
		}
		if fp.Err == nil && fp.HighWatermark >= 0 {
			// franz-go's own notices (data loss, a topic not authorised)
			// carry a zero, not a high watermark. Read committed, the end
			// is the last stable offset (see listEnds).
			p.hwm, p.hwmAt = fp.HighWatermark, time.Now()
			if s.readCommitted && fp.LastStableOffset >= 0 {
				p.hwm = fp.LastStableOffset
			}
		}
		if p.lastPolled < 0 && len(fp.Records) > 0 {
			if fp.Records[0].Offset < p.committed {
				// Fetching started below the committed offset (the log
				// was truncated or recreated, and the client reset): the
				// done offsets in the commit metadata describe other
				// records.
				p.skip = nil
			}
			notices = errors.Join(notices, s.expiredLocked(p, fp.Records[0].Offset, fp.LogStartOffset))
		}
		for _, r := range fp.Records {
			if r.Offset <= p.lastPolled {
				continue // already polled: a refetch, not new records
			}
			p.lastPolled = r.Offset
			p.backlog = append(p.backlog, r)
			s.totalBack++
		}
		s.updatePauseLocked(p)
	})
	return refetch, lose, notices
}
