package kafka

import (
	"slices"

	"github.com/custody-go/custody/adapters"
)

var (
	_ adapters.Pauser   = (*Source)(nil)
	_ adapters.Assigner = (*Source)(nil)
)

// Pause implements adapters.Pauser: the client stops fetching the Source's
// topics (kgo.Client.PauseFetchTopics), so that nothing more is read ahead
// while the consumer is paused, and the member stays in its group: it keeps
// its partitions, heartbeats and commits as usual, and partitions assigned
// to it meanwhile are paused too. Records already fetched stay where they
// are, in the client or in the Source, and are handed out after Resume.
// The runtime calls it from consumer.Consumer.Pause; calling it on a closed
// Source does nothing.
//
// The Source also pauses single partitions on its own, while a partition's
// records waiting and handed out reach WithMaxUnackedPerPartition
// (kgo.Client.PauseFetchPartitions). The two are kept apart: the client
// fetches a partition only when neither its topic nor the partition itself
// is paused, so Resume does not resume a full partition, and an ack that
// makes room does not resume a paused Source's partition.
func (s *Source) Pause() {
	s.pauseMu.Lock()
	defer s.pauseMu.Unlock()
	s.mu.Lock()
	if s.closing || s.closed || s.intakePaused {
		s.mu.Unlock()
		return
	}
	s.intakePaused = true
	s.pausedTopics = s.topicsLocked()
	topics := s.pausedTopics
	s.mu.Unlock()
	s.cl.PauseFetchTopics(topics...)
}

// Resume implements adapters.Pauser: the client fetches the Source's topics
// again, but for the partitions the Source holds paused for their bound
// (see Pause).
func (s *Source) Resume() {
	s.pauseMu.Lock()
	defer s.pauseMu.Unlock()
	s.mu.Lock()
	if !s.intakePaused {
		s.mu.Unlock()
		return
	}
	s.intakePaused = false
	topics := s.pausedTopics
	s.pausedTopics = nil
	s.mu.Unlock()
	s.cl.ResumeFetchTopics(topics...)
}

// topicsLocked returns the Source's topics and those of its assigned
// partitions (the same, unless the client's options subscribe it to more).
func (s *Source) topicsLocked() []string {
	topics := slices.Clone(s.cfg.topics)
	for _, p := range s.order {
		if !slices.Contains(topics, p.topic) {
			topics = append(topics, p.topic)
		}
	}
	return topics
}

// pauseAssignedLocked pauses the topics of newly assigned partitions while
// the Source is paused, for those not paused yet (see topicsLocked): the
// client keeps a paused topic paused across rebalances.
func (s *Source) pauseAssignedLocked(assigned map[string][]int32) {
	if !s.intakePaused {
		return
	}
	var more []string
	for topic := range assigned {
		if !slices.Contains(s.pausedTopics, topic) {
			more = append(more, topic)
			s.pausedTopics = append(s.pausedTopics, topic)
		}
	}
	if len(more) > 0 {
		s.cl.PauseFetchTopics(more...)
	}
}

// Assigned implements adapters.Assigner: the partitions assigned to this
// member, as "topic/partition", by topic, then by partition number. A
// partition being revoked stays in the list until its revoke ends.
func (s *Source) Assigned() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.order))
	for _, p := range s.order {
		if !p.fenced {
			out = append(out, p.lane)
		}
	}
	return out
}
