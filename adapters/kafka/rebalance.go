package kafka

import (
	"context"
	"sort"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// onAssigned opens a new epoch for every assigned partition.
func (s *Source) onAssigned(_ context.Context, _ *kgo.Client, assigned map[string][]int32) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for topic, parts := range assigned {
		for _, id := range parts {
			k := tpKey{topic, id}
			if old := s.parts[k]; old != nil {
				old.fenced = true // cannot happen with a well-behaved group; be safe
				s.dropBacklogLocked(old)
				s.totalHeld -= old.nheld
			}
			s.epoch++
			s.parts[k] = newPartition(topic, id, s.epoch)
		}
	}
	s.rebuildOrderLocked()
	s.pauseAssignedLocked(assigned)
}

// onOffsetsFetched reads the committed offset and the done offsets beyond it
// recorded in the commit metadata, before fetching starts.
func (s *Source) onOffsetsFetched(_ context.Context, _ *kgo.Client, resp *kmsg.OffsetFetchResponse) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	read := func(topic string, part int32, offset int64, leaderEpoch int32, meta *string) {
		p := s.parts[tpKey{topic, part}]
		if p == nil || p.hasTracked || p.lastPolled >= 0 {
			return
		}
		if offset >= 0 {
			p.committed = offset
		}
		if meta != nil {
			p.skip = decodeDone(*meta, offset, leaderEpoch)
		}
	}
	for _, t := range resp.Topics {
		for _, pt := range t.Partitions {
			if pt.ErrorCode == 0 {
				read(t.Topic, pt.Partition, pt.Offset, pt.LeaderEpoch, pt.Metadata)
			}
		}
	}
	for _, g := range resp.Groups {
		for _, t := range g.Topics {
			for _, pt := range t.Partitions {
				if pt.ErrorCode == 0 {
					read(t.Topic, pt.Partition, pt.Offset, pt.LeaderEpoch, pt.Metadata)
				}
			}
		}
	}
	return nil
}

// onRevoked drains, fences and commits the revoked partitions: see the
// package documentation, section Rebalances.
func (s *Source) onRevoked(ctx context.Context, cl *kgo.Client, revoked map[string][]int32) {
	s.mu.Lock()
	ps := s.partitionsLocked(revoked)
	var waits []chan struct{}
	recalled := false
	for _, p := range ps {
		p.draining = true
		s.dropBacklogLocked(p)
		if p.nheld > 0 && !s.closing {
			p.drained = make(chan struct{})
			waits = append(waits, p.drained)
		}
		recalled = p.recallHeld() || recalled
	}
	s.mu.Unlock()
	if recalled {
		notify(s.recalls) // the runtime looks at every delivery recalled
	}
	// franz-go keeps pauses across rebalances: a partition paused now and
	// assigned back later would never be fetched. Resumed once draining is
	// set, since nothing pauses a draining partition.
	cl.ResumeFetchPartitions(revoked)

	if len(waits) > 0 {
		t := time.NewTimer(s.cfg.revokeDrain)
	wait:
		for _, ch := range waits {
			select {
			case <-ch:
			case <-t.C:
				break wait
			case <-ctx.Done():
				break wait
			}
		}
		t.Stop()
	}

	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	s.mu.Lock()
	toCommit := s.snapshotLocked(ps)
	lose := s.fenceLocked(ps)
	s.mu.Unlock()
	for _, h := range lose {
		h.sig.Lose(adapters.ErrRevoked)
	}
	cctx, cancel := context.WithTimeout(context.Background(), s.cfg.commitTimeout)
	defer cancel()
	s.send(cctx, toCommit)
}

// onLost fences the lost partitions without committing: they may already be
// someone else's.
func (s *Source) onLost(_ context.Context, cl *kgo.Client, lost map[string][]int32) {
	s.mu.Lock()
	ps := s.partitionsLocked(lost)
	for _, p := range ps {
		s.dropBacklogLocked(p)
	}
	lose := s.fenceLocked(ps)
	s.mu.Unlock()
	// Resumed once fenced, so that nothing pauses them again (see onRevoked).
	cl.ResumeFetchPartitions(lost)
	for _, h := range lose {
		h.sig.Lose(adapters.ErrRevoked)
	}
}

func (s *Source) partitionsLocked(tps map[string][]int32) []*partition {
	var ps []*partition
	for topic, parts := range tps {
		for _, id := range parts {
			if p := s.parts[tpKey{topic, id}]; p != nil && !p.fenced {
				ps = append(ps, p)
			}
		}
	}
	return ps
}

func (s *Source) dropBacklogLocked(p *partition) {
	s.totalBack -= len(p.backlog) - p.backHead
	p.backlog, p.backHead, p.requeue = nil, 0, nil
}

// fenceLocked marks the partitions fenced, forgets them, and returns the
// records still held so the caller can lose them outside the lock.
func (s *Source) fenceLocked(ps []*partition) []*held {
	var lose []*held
	for _, p := range ps {
		p.fenced = true
		s.totalHeld -= p.nheld
		lose = p.dropHeld(lose)
		p.drained = nil
		if s.parts[tpKey{p.topic, p.id}] == p {
			delete(s.parts, tpKey{p.topic, p.id})
		}
		s.tel.forget(p)
	}
	s.rebuildOrderLocked()
	notify(s.wake)
	return lose
}

func (s *Source) rebuildOrderLocked() {
	s.order = s.order[:0]
	for _, p := range s.parts {
		s.order = append(s.order, p)
	}
	sort.Slice(s.order, func(i, j int) bool {
		a, b := s.order[i], s.order[j]
		if a.topic != b.topic {
			return a.topic < b.topic
		}
		return a.id < b.id
	})
	s.rr = 0
}
