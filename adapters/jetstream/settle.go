package jetstream

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/custody-go/custody/adapters"
)

// The bodies of acknowledgement messages, as the server reads them.
var (
	ackAck      = []byte("+ACK")
	ackNak      = []byte("-NAK")
	ackProgress = []byte("+WPI")
	ackTerm     = []byte("+TERM")
)

// Errors of entries the Source refuses without asking the server.
var (
	errForeign  = errors.New("jetstream: the delivery did not come from this Source's consumer")
	errNacked   = errors.New("jetstream: the delivery was given back (nak); the server delivers it again")
	errSettling = errors.New("jetstream: another ack, nak or term of this delivery is under way")
)

// Ack acknowledges each delivery with an acknowledged ack (the "double
// ack"): an entry succeeds once the server replied; one not answered within
// WithRequestTimeout fails, and the message may come back. Acking a
// delivery again, or one the Source's dead-letter destinations settled,
// succeeds without a request (adapters.OriginalSettler); acking one given
// back (Nack) fails.
func (s *Source) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	return s.settle(ctx, ds, opAck, func(int) []byte { return ackAck }, stateAcked)
}

// Nack gives each delivery back to be redelivered after its After: a nak
// with that delay (NakWithDelay, cut to a year), or a plain nak for zero or
// less, awaiting the server's reply as Ack does. A delivery whose lease may
// have run out (see Extend) fails with adapters.ErrLeaseLost and is not
// sent: the message comes back by itself.
func (s *Source) Nack(ctx context.Context, ns []adapters.Nack) error {
	ds := make([]*adapters.Delivery, len(ns))
	for i, n := range ns {
		ds[i] = n.Delivery
	}
	return s.settle(ctx, ds, opNak, func(i int) []byte { return nakBody(ns[i].After) }, stateNacked)
}

// nakBody is a nak's message, with a delay in the JSON form of servers
// since 2.7.1.
func nakBody(after time.Duration) []byte {
	if after <= 0 {
		return ackNak
	}
	after = min(after, maxNakDelay)
	return []byte(`-NAK {"delay": ` + strconv.FormatInt(after.Nanoseconds(), 10) + `}`)
}

// term stops redelivery of each delivery for good (+TERM, with an advisory
// the server publishes), awaiting the server's reply.
func (s *Source) term(ctx context.Context, ds []*adapters.Delivery) error {
	return s.settle(ctx, ds, opTerm, func(int) []byte { return ackTerm }, stateTermed)
}

// settle sends body(i) to the ack subject of ds[i] and moves the deliveries
// the server answered for to state to. A delivery is settled once: an entry
// already in state to, or settled by its dead-letter destination, succeeds
// without a request; one settled otherwise fails.
func (s *Source) settle(ctx context.Context, ds []*adapters.Delivery, op int, body func(i int) []byte, to settleState) error {
	now := time.Now()
	hs, errs, err := s.exchange(ctx, ds, op == opAck && s.opts.unconfirmedAcks, func(i int, h *handle) ([]byte, error) {
		switch h.state {
		case stateHeld:
			if op == opNak && !now.Before(h.leasedUntil) {
				// The nak would act on the redelivery another consumer may
				// run: redeliver it beside that run, or reset its timer.
				return nil, fmt.Errorf("%w: message %s was last renewed more than AckWait (%v) ago; not given back, since the server may have delivered it again", adapters.ErrLeaseLost, ds[i].ID, s.caps.Lease)
			}
			h.state = stateSettling
			return body(i), nil
		case to, stateTermed, stateLeft:
			// A repeat, or settled by its dead-letter destination: the
			// server delivers it no more, and a request could only
			// disturb the message's advisory.
			return nil, errAlready
		case stateNacked:
			return nil, errNacked
		case stateSettling:
			return nil, errSettling
		}
		return nil, fmt.Errorf("jetstream: the delivery was already settled (%s)", h.state)
	})
	if err != nil {
		return err
	}
	for i, err := range errs {
		h := hs[i]
		if h == nil {
			continue
		}
		h.mu.Lock()
		if err == nil {
			h.state = to
		} else {
			h.state = stateHeld
		}
		h.mu.Unlock()
		if err != nil {
			errs[i] = fmt.Errorf("jetstream: %s of message %s: %w", opNames[op], ds[i].ID, err)
		}
	}
	return s.result(op, hs, errs)
}

// exchange sends each delivery of ds what next, called under the
// delivery's lock, returns for it: a body to its reply subject, or an error
// that is the entry's result without a request. It sends every body at once
// and returns the handles it sent for (nil for the others) with each
// entry's result; with publish, it waits for no reply (unconfirmed acks, a
// benchmark knob). After Close it fails with adapters.ErrClosed.
func (s *Source) exchange(ctx context.Context, ds []*adapters.Delivery, publish bool, next func(i int, h *handle) ([]byte, error)) ([]*handle, []error, error) {
	if len(ds) == 0 {
		return nil, nil, nil
	}
	if s.isClosed() {
		return nil, nil, adapters.ErrClosed
	}
	reqs := make([]request, len(ds))
	hs := make([]*handle, len(ds))
	for i, d := range ds {
		h, ok := d.Handle.(*handle)
		if !ok || h.src != s {
			reqs[i].skip = errForeign
			continue
		}
		h.mu.Lock()
		body, err := next(i, h)
		h.mu.Unlock()
		if err != nil {
			reqs[i].skip = err
			continue
		}
		hs[i] = h
		reqs[i] = request{subject: h.reply, body: body}
	}
	if publish {
		return hs, s.replies.publish(reqs), nil
	}
	rctx, cancel := context.WithTimeout(ctx, s.opts.requestTimeout)
	defer cancel()
	return hs, s.replies.send(rctx, reqs), nil
}

// result counts the requests of op made for the entries sent names, and
// returns errs as the result of the call: entries that failed with
// errAlready succeed, without a request.
func (s *Source) result(op int, sent []*handle, errs []error) error {
	var failed map[int]error
	n, bad := 0, 0
	for i, err := range errs {
		if sent[i] != nil {
			n++
			if err != nil {
				bad++
			}
		}
		if err != nil && err != errAlready {
			if failed == nil {
				failed = make(map[int]error)
			}
			failed[i] = err
		}
	}
	s.stats.count(op, n, bad)
	s.tel.requests(op, n-bad, bad)
	if failed != nil {
		return &adapters.BatchError{Failed: failed}
	}
	return nil
}

var errAlready = errors.New("already settled")

var stateNames = [...]string{"held", "settling", "acked", "nacked", "terminated", "left to MaxDeliver"}

func (st settleState) String() string {
	if int(st) < len(stateNames) {
		return stateNames[st]
	}
	return "unknown"
}

// Extend renews the lease of each delivery with InProgress (+WPI), which
// resets its AckWait to the full length (d is the AckWait: all the server
// grants), and awaits the server's reply. A delivery whose lease may have
// run out by this process's clock fails with adapters.ErrLeaseLost and is
// not renewed (see Leases in the package documentation); one given back
// fails alike. One being acked, acked or terminated succeeds without a
// request.
func (s *Source) Extend(ctx context.Context, ds []*adapters.Delivery, d time.Duration) error {
	now := time.Now()
	hs, errs, err := s.exchange(ctx, ds, false, func(i int, h *handle) ([]byte, error) {
		switch h.state {
		case stateHeld:
			if !now.Before(h.leasedUntil) {
				s.stats.leaseLost.Add(1)
				return nil, fmt.Errorf("%w: message %s was last renewed more than AckWait (%v) ago, so the server may have delivered it again", adapters.ErrLeaseLost, ds[i].ID, s.caps.Lease)
			}
			return ackProgress, nil
		case stateNacked:
			return nil, fmt.Errorf("%w: %w", adapters.ErrLeaseLost, errNacked)
		}
		return nil, errAlready
	})
	if err != nil {
		return err
	}
	for i, err := range errs {
		h := hs[i]
		switch {
		case h == nil:
		case err == nil:
			h.mu.Lock()
			if until := now.Add(s.caps.Lease); until.After(h.leasedUntil) {
				h.leasedUntil = until
			}
			h.mu.Unlock()
		default:
			errs[i] = fmt.Errorf("jetstream: renewing message %s: %w", ds[i].ID, err)
		}
	}
	return s.result(opProgress, hs, errs)
}
