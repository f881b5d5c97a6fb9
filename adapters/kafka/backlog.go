package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kadm"
)

var _ adapters.BacklogReporter = (*Source)(nil)

// Backlog implements adapters.BacklogReporter with the group's lag over the
// partitions assigned to this member, from one ListOffsets request per
// broker for their end offsets (see listEnds), and one more for their start
// offsets while a partition has no committed offset yet. The committed
// offsets are the Source's own: fetched on assignment, then those it
// commits.
//
// Waiting is the sum of end offset minus committed offset (or log start,
// where nothing is committed), as kadm's Lag and kafka-consumer-groups.sh
// count: offsets, not records (transaction markers and offsets compaction
// emptied count too). Each member reports its own partitions; a partition
// being moved is in no member's while it has no owner. InFlight is, of
// Waiting, the records this member fetched and has not committed: handed
// out, waiting in the Source, or done and waiting for the next commit
// (Status().Held is the handed-out share alone). OldestAge stays zero:
// Kafka tells a record's timestamp only by fetching it.
//
// It fails with adapters.ErrClosed once the Source is closed, and with the
// listing's error, naming the partition, while the brokers do not answer.
// The ends listed also feed the custody.kafka.lag gauge.
func (s *Source) Backlog(ctx context.Context) (adapters.Backlog, error) {
	var topics []string
	uncommitted := false
	s.mu.Lock()
	if s.closing || s.closed {
		s.mu.Unlock()
		return adapters.Backlog{}, adapters.ErrClosed
	}
	for _, p := range s.order {
		if p.fenced {
			continue
		}
		if !slices.Contains(topics, p.topic) {
			topics = append(topics, p.topic)
		}
		uncommitted = uncommitted || p.committed < 0
	}
	s.mu.Unlock()
	if len(topics) == 0 {
		return adapters.Backlog{}, nil
	}

	asked := time.Now()
	ends, err := s.listEnds(ctx, topics)
	if err != nil && len(ends) == 0 {
		return adapters.Backlog{}, fmt.Errorf("kafka: backlog of group %q: listing end offsets: %w", s.cfg.group, err)
	}
	var starts kadm.ListedOffsets
	if uncommitted {
		starts, err = kadm.NewClient(s.cl).ListStartOffsets(ctx, topics...)
		if err != nil && len(starts) == 0 {
			return adapters.Backlog{}, fmt.Errorf("kafka: backlog of group %q: listing start offsets: %w", s.cfg.group, err)
		}
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	s.noteEndsLocked(ends, asked)
	var b adapters.Backlog
	for _, p := range s.order {
		if p.fenced {
			continue
		}
		end, ok := ends.Lookup(p.topic, p.id)
		if !ok || end.Err != nil {
			// Assigned since the listing: its end is unknown. A listing
			// error leaves a sum that would look like progress.
			if !ok && !slices.Contains(topics, p.topic) {
				continue
			}
			if end.Err == nil {
				end.Err = errors.New("the brokers did not list it")
			}
			return adapters.Backlog{}, fmt.Errorf("kafka: backlog of group %q: listing the end offset of %s: %w", s.cfg.group, p.lane, end.Err)
		}
		from := p.committed
		if from < 0 {
			from = 0 // as kadm counts a partition whose start is unknown
			if st, ok := starts.Lookup(p.topic, p.id); ok && st.Err == nil && st.Offset >= 0 {
				from = st.Offset
			}
		}
		b.Waiting += max(0, end.Offset-from)
		if p.lastPolled >= from {
			b.InFlight += max(0, min(p.lastPolled+1, end.Offset)-from)
		}
	}
	return b, nil
}
