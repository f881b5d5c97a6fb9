package jetstream

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/custody-go/custody/adapters"
)

var _ adapters.BacklogReporter = (*Source)(nil)

// Backlog asks the server for the consumer's backlog
// (adapters.BacklogReporter), which the runtime polls (see
// consumer.WithBacklogInterval):
//
//   - Waiting is the consumer's NumPending: messages of the stream, on its
//     filter subjects, that it has not delivered yet.
//   - InFlight is its NumAckPending: messages delivered and not yet acked or
//     terminated, whether a consumer holds them or they were given back
//     (nak) and wait to be delivered again.
//   - OldestAge is how long ago the stream stored the next message the
//     consumer will deliver for the first time: the first one after its
//     delivered stream sequence, on its filter subject (one per filter
//     subject when it has several), measured by this process's clock.
//
// The counts cost one request (the consumer's info); the age one more per
// filter subject, made only while messages wait, which brings the message
// with its body (and, on the first poll, one to look the stream up).
func (s *Source) Backlog(ctx context.Context) (adapters.Backlog, error) {
	if s.isClosed() {
		return adapters.Backlog{}, adapters.ErrClosed
	}
	info, err := s.cons.Info(ctx)
	s.backlogRequest(err)
	if err != nil {
		return adapters.Backlog{}, fmt.Errorf("jetstream: asking for the info of consumer %q of stream %q: %w", s.consumer, s.stream, err)
	}
	b := adapters.Backlog{Waiting: int64(info.NumPending), InFlight: int64(info.NumAckPending)}
	if info.NumPending == 0 {
		return b, nil
	}
	stored, err := s.nextStored(ctx, info)
	if err != nil {
		return adapters.Backlog{}, err
	}
	if !stored.IsZero() {
		b.OldestAge = max(time.Since(stored), 0)
	}
	return b, nil
}

// nextStored returns when the stream stored the first message after the
// consumer's delivered sequence on its filter subjects: the zero time when
// there is none (it was deleted since the info was read).
func (s *Source) nextStored(ctx context.Context, info *jetstream.ConsumerInfo) (time.Time, error) {
	st, err := s.streamForGets(ctx)
	if err != nil {
		return time.Time{}, err
	}
	filters := info.Config.FilterSubjects
	if info.Config.FilterSubject != "" {
		filters = []string{info.Config.FilterSubject}
	}
	if len(filters) == 0 {
		filters = []string{">"}
	}
	var (
		first time.Time
		seq   uint64
	)
	for _, subject := range filters {
		m, err := st.GetMsg(ctx, info.Delivered.Stream+1, jetstream.WithGetMsgSubject(subject))
		s.backlogRequest(err)
		switch {
		case errors.Is(err, jetstream.ErrMsgNotFound):
		case err != nil:
			return time.Time{}, fmt.Errorf("jetstream: reading the next message of consumer %q of stream %q on %q, for its age: %w", s.consumer, s.stream, subject, err)
		case seq == 0 || m.Sequence < seq:
			first, seq = m.Time, m.Sequence
		}
	}
	return first, nil
}

// streamForGets returns the stream, looked up on first use.
func (s *Source) streamForGets(ctx context.Context) (jetstream.Stream, error) {
	s.streamMu.Lock()
	defer s.streamMu.Unlock()
	if s.streamHandle != nil {
		return s.streamHandle, nil
	}
	st, err := s.js.Stream(ctx, s.stream)
	s.backlogRequest(err)
	if err != nil {
		return nil, fmt.Errorf("jetstream: looking up stream %q, for the age of its oldest message: %w", s.stream, err)
	}
	s.streamHandle = st
	return st, nil
}

// backlogRequest counts a request of Backlog that returned err;
// jetstream.ErrMsgNotFound is an answer, not a failure.
func (s *Source) backlogRequest(err error) {
	failed := 0
	if err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
		failed = 1
	}
	s.tel.request(opBacklog, failed == 1)
	s.stats.count(opBacklog, 1, failed)
}
