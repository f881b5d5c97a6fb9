package kafka

import (
	"context"
	"slices"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
)

// lagLoop keeps the partitions' end offsets fresh for the lag gauge: every
// lagRefresh it asks the brokers for the end of the partitions no fetch has
// reported on for that long. It ends when Close cancels ctx, which also cuts
// a listing short.
func (s *Source) lagLoop(ctx context.Context) {
	defer close(s.lagDone)
	if s.cfg.lagRefresh <= 0 {
		return
	}
	t := time.NewTicker(s.cfg.lagRefresh)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		lctx, cancel := context.WithTimeout(ctx, min(s.cfg.commitTimeout, s.cfg.lagRefresh))
		s.refreshEnds(lctx)
		cancel()
	}
}

// refreshEnds lists the end offsets of the owned partitions whose end is
// unknown or older than lagRefresh: the high watermarks, or read committed
// the last stable offsets. A failed listing is left to the next tick; the
// lag keeps its last value meanwhile.
func (s *Source) refreshEnds(ctx context.Context) {
	asked := time.Now()
	var topics []string
	s.mu.Lock()
	for _, p := range s.order {
		if p.fenced || (p.hwm >= 0 && asked.Sub(p.hwmAt) < s.cfg.lagRefresh) {
			continue
		}
		if !slices.Contains(topics, p.topic) {
			topics = append(topics, p.topic)
		}
	}
	s.mu.Unlock()
	if len(topics) == 0 {
		return
	}
	ends, _ := s.listEnds(ctx, topics) // a shard's error leaves its partitions out
	s.mu.Lock()
	defer s.mu.Unlock()
	s.noteEndsLocked(ends, asked)
}

// listEnds lists the end offsets of the partitions of topics, in one
// ListOffsets request per broker: the high watermarks, or read committed
// the last stable offsets (records of a transaction still open cannot be
// read yet, so they are no lag; Kafka's own consumer counts the same way).
func (s *Source) listEnds(ctx context.Context, topics []string) (kadm.ListedOffsets, error) {
	adm := kadm.NewClient(s.cl)
	if s.readCommitted {
		return adm.ListCommittedOffsets(ctx, topics...)
	}
	return adm.ListEndOffsets(ctx, topics...)
}

// noteEndsLocked keeps the ends listed at asked as the assigned partitions'
// ends, but where a fetch brought a fresher one since.
func (s *Source) noteEndsLocked(ends kadm.ListedOffsets, asked time.Time) {
	for _, p := range s.order {
		if p.fenced || p.hwmAt.After(asked) {
			continue
		}
		if o, ok := ends.Lookup(p.topic, p.id); ok && o.Err == nil && o.Offset >= 0 {
			p.hwm, p.hwmAt = o.Offset, asked
		}
	}
}
