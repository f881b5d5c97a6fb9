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
// topics (kgo.Client.PauseFetchTopics) while the member stays in its group,
// keeping its partitions, heartbeats and commits; partitions assigned
// meanwhile are paused too. Records already fetched are handed out after
// Resume. It is kept apart from the Source's own pause of a partition at
// its bound: see the package documentation, section Operations. On a
// closed Source it does nothing.
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
// again, but for the partitions paused at their bound.
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

// updatePauseLocked pauses fetching a partition whose backlog and
// handed-out records reach its bound, or whose backlog waits for room in
// the commit metadata, and resumes it otherwise.
func (s *Source) updatePauseLocked(p *partition) {
	full := p.backlogLen()+p.nheld >= s.cfg.maxPerPart ||
		(p.backlogLen() > 0 && !p.fits(2, s.cfg.metadataLimit))
	if full == p.paused || p.fenced || p.draining {
		return
	}
	p.paused = full
	tp := map[string][]int32{p.topic: {p.id}}
	if full {
		s.cl.PauseFetchPartitions(tp)
	} else {
		s.cl.ResumeFetchPartitions(tp)
	}
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

// pauseAssignedLocked pauses, while the Source is paused, the topics of
// newly assigned partitions not paused yet (the client keeps a paused topic
// paused across rebalances).
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
