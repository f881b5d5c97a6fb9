package jetstream

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/custody-go/custody/adapters"
)

// Receive fetches up to max messages (at most WithMaxFetch): a no-wait
// pull, and when it brings nothing, a pull waiting up to WithPollWait for
// one message followed by a no-wait pull for the rest of the room. It
// returns no message and a nil error when the wait ended with none, ctx's
// error when ctx is done, and adapters.ErrClosed after Close; messages a
// pull brings after either are given back at once (nak).
func (s *Source) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	if max <= 0 {
		return nil, nil
	}
	if s.isClosed() {
		return nil, adapters.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	n := min(max, s.opts.maxFetch)
	ds, err := s.fetch(ctx, n, false)
	if len(ds) == 0 && err == nil {
		ds, err = s.fetch(ctx, 1, true)
		if len(ds) == 1 && n > 1 && err == nil {
			var more []*adapters.Delivery
			more, err = s.fetch(ctx, n-1, false)
			ds = append(ds, more...)
		}
	}
	if s.isClosed() {
		s.giveBack(ds)
		return nil, adapters.ErrClosed
	}
	if cerr := ctx.Err(); cerr != nil {
		s.giveBack(ds)
		return nil, cerr
	}
	if len(ds) == 0 {
		return nil, err
	}
	// Messages came before a failure: hand them out; the next Receive meets
	// the failure again if it lasts.
	return ds, nil
}

// fetch makes one pull request for up to n messages: without waiting, or,
// when wait is set, waiting up to the poll wait for the first.
func (s *Source) fetch(ctx context.Context, n int, wait bool) ([]*adapters.Delivery, error) {
	s.stats.fetches.Add(1)
	sent := time.Now()
	var (
		batch jetstream.MessageBatch
		err   error
	)
	if wait {
		wctx, cancel := context.WithTimeout(ctx, s.opts.pollWait)
		defer cancel()
		stop := context.AfterFunc(s.closeCtx, cancel)
		defer stop()
		batch, err = s.cons.Fetch(n, jetstream.FetchContext(wctx))
	} else {
		batch, err = s.cons.FetchNoWait(n)
	}
	if err != nil {
		return nil, s.fetchFailed(err)
	}
	var ds []*adapters.Delivery
	for m := range batch.Messages() {
		// The server started the message's AckWait when it sent it: no
		// earlier than the pull request (a no-wait pull is answered at
		// once), and shortly before it arrives (a waiting pull).
		at := sent
		if wait {
			at = time.Now()
		}
		d, err := s.delivery(m, at)
		if err != nil {
			// Not a JetStream message (no metadata): it cannot be acked.
			s.stats.fetchErrors.Add(1)
			continue
		}
		ds = append(ds, d)
	}
	s.stats.received.Add(int64(len(ds)))
	if len(ds) == 0 {
		s.stats.emptyFetches.Add(1)
		if !wait && batch.Error() == nil && time.Since(sent) < time.Second {
			// Answered (nats.go gives an unanswered no-wait pull up after
			// a second): the server answers one with nothing when the
			// consumer has nothing to deliver.
			s.stats.pending.Store(0)
		}
	}
	switch err := batch.Error(); {
	case err == nil:
	case ctx.Err() != nil || s.closeCtx.Err() != nil:
		// Cut short on purpose: Receive decides.
	case wait && len(ds) == 0 && isTimeout(err):
		// The wait ended with no message.
	default:
		return ds, s.fetchFailed(err)
	}
	s.tel.request(opFetch, false)
	return ds, nil
}

// fetchFailed counts a failed pull request and returns its error.
func (s *Source) fetchFailed(err error) error {
	s.stats.fetchErrors.Add(1)
	s.tel.request(opFetch, true)
	return fmt.Errorf("jetstream: fetching from consumer %q of stream %q: %w", s.consumer, s.stream, err)
}

func isTimeout(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, jetstream.ErrNoHeartbeat)
}

// delivery turns a fetched message into a Delivery leased from leasedAt.
func (s *Source) delivery(m jetstream.Msg, leasedAt time.Time) (*adapters.Delivery, error) {
	meta, err := m.Metadata()
	if err != nil {
		return nil, err
	}
	s.stats.pending.Store(int64(meta.NumPending))
	d := &adapters.Delivery{
		ID:         meta.Stream + ":" + strconv.FormatUint(meta.Sequence.Stream, 10),
		Body:       m.Data(),
		Attempt:    int(meta.NumDelivered),
		Queue:      meta.Stream,
		Partition:  -1,
		Offset:     -1,
		ReceivedAt: leasedAt,
		Native:     m,
	}
	if !meta.Timestamp.IsZero() {
		// JetStream does not say when it first delivered the message.
		d.PublishedAt = meta.Timestamp
		d.FirstReceivedAt = meta.Timestamp
	}
	if h := m.Headers(); len(h) > 0 {
		d.Headers = make(map[string]string, len(h))
		for k, v := range h {
			if len(v) > 0 {
				d.Headers[k] = v[0]
			}
		}
	}
	if s.opts.keyHeader != "" {
		d.Key = d.Headers[s.opts.keyHeader]
	} else {
		d.Key = m.Subject()
	}
	if s.opts.ordered {
		d.OrderingKey = d.Key
	}
	d.Handle = &handle{src: s, reply: m.Reply(), leasedUntil: leasedAt.Add(s.caps.Lease)}
	return d, nil
}

// giveBack naks, without delay, deliveries fetched but not handed out.
func (s *Source) giveBack(ds []*adapters.Delivery) {
	if len(ds) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.opts.requestTimeout)
	defer cancel()
	// Close may have ended the reply subscription: a nak without a reply
	// still lands; the message otherwise comes back after its AckWait.
	for _, d := range ds {
		if h, ok := d.Handle.(*handle); ok {
			if err := s.nc.Publish(h.reply, ackNak); err == nil {
				h.mu.Lock()
				h.state = stateNacked
				h.mu.Unlock()
			}
		}
	}
	_ = s.nc.FlushWithContext(ctx)
	s.stats.released.Add(int64(len(ds)))
}

// handle is the Delivery.Handle of a delivery received by a Source.
type handle struct {
	src   *Source
	reply string // the message's ack subject

	mu          sync.Mutex
	state       settleState
	leasedUntil time.Time // the lease runs no earlier than this, by this process's clock
}

type settleState uint8

const (
	stateHeld     settleState = iota
	stateSettling             // an ack, nak or term is on the wire
	stateAcked
	stateNacked
	stateTermed
	stateLeft // nacked at the last delivery MaxDeliver allows, by NativeDeadLetter
)

// Message returns the JetStream message a delivery was made from (for a
// DeadLetter of your own; a handler uses m.As(&msg) with msg a
// jetstream.Msg). Do not ack it yourself: the runtime does.
func Message(d *adapters.Delivery) (jetstream.Msg, bool) {
	m, ok := d.Native.(jetstream.Msg)
	return m, ok
}
