package redisstream

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/custody-go/custody/adapters"
)

// ackChunk bounds the ids of one XACK: a larger batch goes out as several
// XACKs in one pipeline, so that no single command holds the server long.
const ackChunk = 1024

// ErrDeleted is wrapped by the error of a Nack entry whose entry was deleted
// from the stream (trimmed, or XDEL) while this consumer held it: there is
// nothing left to deliver again.
var ErrDeleted = errors.New("redisstream: the entry was deleted from the stream while held")

// owns reports whether d came from this Source, or from another one on the
// same client, stream and group (any consumer of a group may XACK its
// entries).
func (s *Source) owns(d *adapters.Delivery) bool {
	h := heldOf(d)
	return h != nil && (h.src == s || (h.src.client == s.client && h.src.stream == s.stream && h.src.group == s.group))
}

func (s *Source) foreign(d *adapters.Delivery) error {
	return fmt.Errorf("redisstream: delivery %q did not come from group %q of stream %q", d.ID, s.group, s.stream)
}

// Ack acknowledges the entries with XACK, all ids in one command (a
// pipeline of several beyond 1024), followed by XDEL in the same round trip
// with WithDeleteOnAck. XACK removes an entry from the group's pending list
// whichever consumer it is assigned to, and an entry no longer pending
// (acked already, or by the consumer that reclaimed it) will not be
// delivered again either: so every entry of a call that reached the server
// succeeds. Only deliveries from another stream, group or client fail,
// alone. An entry a DeadLetter acknowledged with its copy succeeds without
// a command.
func (s *Source) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	s.unhold(ds)
	var failed map[int]error
	ids := make([]string, 0, len(ds))
	for i, d := range ds {
		if !s.owns(d) {
			if failed == nil {
				failed = make(map[int]error)
			}
			failed[i] = s.foreign(d)
			continue
		}
		if isDeadLettered(d) {
			continue // acknowledged by its dead letter: nothing left to do
		}
		ids = append(ids, d.ID)
	}
	if len(ids) > 0 {
		if err := s.xack(ctx, ids); err != nil {
			if failed == nil {
				return err
			}
			for i, d := range ds {
				if s.owns(d) && !isDeadLettered(d) {
					failed[i] = err
				}
			}
		}
		s.forget(ids)
	}
	if failed != nil {
		return &adapters.BatchError{Failed: failed}
	}
	return nil
}

// xack sends XACK (and XDEL) for ids.
func (s *Source) xack(ctx context.Context, ids []string) error {
	if len(ids) <= ackChunk && !s.opts.deleteOnAck {
		s.count(cmdAck)
		sent := time.Now()
		n, err := s.client.XAck(ctx, s.stream, s.group, ids...).Result()
		s.conn.observe(sent, err)
		if err != nil {
			s.failed(cmdAck)
			return fmt.Errorf("redisstream: XACK on stream %q: %w", s.stream, err)
		}
		s.acked(int64(len(ids)), n)
		return nil
	}
	pipe := s.client.Pipeline()
	var acks []interface{ Val() int64 }
	for start := 0; start < len(ids); start += ackChunk {
		chunk := ids[start:min(start+ackChunk, len(ids))]
		s.count(cmdAck)
		acks = append(acks, pipe.XAck(ctx, s.stream, s.group, chunk...))
		if s.opts.deleteOnAck {
			s.count(cmdDelete)
			pipe.XDel(ctx, s.stream, chunk...)
		}
	}
	sent := time.Now()
	cmds, err := pipe.Exec(ctx)
	s.conn.observe(sent, err)
	if err != nil {
		// Which commands failed: an XACK that failed fails the call (the
		// runtime tries it again; XACK is idempotent), an XDEL does not
		// (the entries are acked, only their space is not given back).
		for _, c := range cmds {
			if c.Err() == nil {
				continue
			}
			if c.Name() == "xack" {
				s.failed(cmdAck)
				return fmt.Errorf("redisstream: XACK on stream %q: %w", s.stream, c.Err())
			}
			s.failed(cmdDelete)
			s.logger.Warn("redisstream: XDEL of acknowledged entries failed; they stay in the stream until it is trimmed",
				"stream", s.stream, "error", c.Err())
		}
	}
	var n int64
	for _, a := range acks {
		n += a.Val()
	}
	s.acked(int64(len(ids)), n)
	return nil
}

func (s *Source) acked(sent, n int64) {
	s.stats.acked.Add(n)
	if sent > n {
		s.stats.ackedNotPending.Add(sent - n)
	}
}

// forget drops acked ids from the set of entries deleted while held.
func (s *Source) forget(ids []string) {
	s.mu.Lock()
	if len(s.gone) > 0 {
		for _, id := range ids {
			delete(s.gone, id)
		}
	}
	s.mu.Unlock()
}

// isGone reports whether id was found deleted from the stream while held.
func (s *Source) isGone(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.gone[id]
	return ok
}

// Extend renews the entries' lease in one script call that, for each entry
// this consumer still owns, resets its idle time so that another consumer
// can claim it only d from now (see Leases in the package documentation).
// An entry another consumer claimed, or no longer pending (claimed and
// acked elsewhere; the group recreated), fails with an error wrapping
// adapters.ErrLeaseLost. An entry deleted from the stream while held
// succeeds: no one else can be handed it, so its handler runs on; it is
// counted (Stats.DeletedWhileHeld) and not renewed again. Extend returns
// when ctx ends, answered or not (see renew).
func (s *Source) Extend(ctx context.Context, ds []*adapters.Delivery, d time.Duration) error {
	idle := min(max(s.opts.lease-d, 0), s.opts.lease).Milliseconds()
	args := make([]any, 0, 3+2*len(ds))
	args = append(args, s.group, s.consumer, idle)
	idx := make([]int, 0, len(ds)) // ds index of each id sent
	failed := map[int]error{}
	for i, dl := range ds {
		switch {
		case !s.owns(dl):
			failed[i] = s.foreign(dl)
		case s.isGone(dl.ID), isDeadLettered(dl):
			// Deleted while held, or acknowledged by its dead letter:
			// nothing to renew, and no one to lose it to.
		default:
			args = append(args, dl.ID, heldOf(dl).count)
			idx = append(idx, i)
		}
	}
	if len(idx) > 0 {
		s.count(cmdExtend)
		res, err := s.renew(ctx, args)
		if err := s.settled(cmdExtend, ds, idx, res, err, failed, func(int) { s.stats.renewed.Add(1) }); err != nil {
			return err
		}
	}
	if len(failed) > 0 {
		var lost []*adapters.Delivery
		for i, err := range failed {
			if errors.Is(err, adapters.ErrLeaseLost) {
				lost = append(lost, ds[i])
			}
		}
		s.unhold(lost)
		return &adapters.BatchError{Failed: failed}
	}
	return nil
}

// renew runs the renewal script, returning when ctx ends even if the server
// has not answered: go-redis bounds a call by its ReadTimeout, not by the
// context's deadline (unless ContextTimeoutEnabled), and the lease keeper
// needs an answer before the lease runs out, to cancel the handler in time.
// A renewal that reaches the server later is harmless: it checks the owner
// first. Close waits for such calls.
func (s *Source) renew(ctx context.Context, args []any) ([]any, error) {
	sent := time.Now()
	run := func() ([]any, error) {
		res, err := extendScript.Run(ctx, s.client, []string{s.stream}, args...).Slice()
		s.conn.observe(sent, err)
		return res, err
	}
	if ctx.Done() == nil {
		return run()
	}
	type result struct {
		res []any
		err error
	}
	done := make(chan result, 1)
	s.calls.Add(1)
	go func() {
		defer s.calls.Done()
		res, err := run()
		done <- result{res, err}
	}()
	select {
	case r := <-done:
		return r.res, r.err
	case <-ctx.Done():
		return nil, fmt.Errorf("no answer before the renewal's deadline: %w", ctx.Err())
	}
}

// settled applies the outcome of a call of extendScript (cmd cmdExtend) or
// nackScript (cmdNack) for the deliveries ds[idx[k]]: it calls ok for
// those done and fills failed for the others. A failed call fails every
// entry sent, lost with the group on NOGROUP; settled returns the call's
// error instead when no other entry failed. An answer holds per entry 1
// (done), 0 (not pending), 2 (deleted from the stream), 3 (delivered again
// since, to this consumer) or the consumer that claimed it.
func (s *Source) settled(cmd int, ds []*adapters.Delivery, idx []int, res []any, err error, failed map[int]error, ok func(i int)) error {
	op, doing := "nack", "giving back"
	if cmd == cmdExtend {
		op, doing = "renewal", "renewing"
	}
	switch {
	case err != nil && isNoGroup(err):
		s.failed(cmd)
		for _, i := range idx {
			failed[i] = fmt.Errorf("%w: %w: stream %q, group %q", adapters.ErrLeaseLost, ErrGroupMissing, s.stream, s.group)
		}
		if cmd == cmdExtend {
			s.stats.leaseLost.Add(int64(len(idx)))
		}
		return nil
	case err != nil:
		s.failed(cmd)
		err = fmt.Errorf("redisstream: %s %d entries of stream %q: %w", doing, len(idx), s.stream, err)
		if len(failed) == 0 {
			return err
		}
		for _, i := range idx {
			failed[i] = err
		}
		return nil
	}
	for k, i := range idx {
		var r any
		if k < len(res) {
			r = res[k]
		}
		id := ds[i].ID
		switch r := r.(type) {
		case int64:
			switch r {
			case 1:
				ok(i)
			case 2:
				s.deletedWhileHeld(id)
				if cmd != cmdExtend {
					failed[i] = fmt.Errorf("%w: entry %s of stream %q", ErrDeleted, id, s.stream)
				}
			case 3:
				// Claimed again by this consumer: a later delivery of the
				// entry runs, or waits, here.
				s.stats.leaseLost.Add(1)
				failed[i] = fmt.Errorf("%w: entry %s of stream %q was delivered again since: this consumer claimed it again (its give-back fell due, or it was idle for the lease)",
					adapters.ErrLeaseLost, id, s.stream)
			default:
				s.stats.leaseLost.Add(1)
				if s.lostWithGroup(ds[i]) {
					failed[i] = fmt.Errorf("%w: %w: entry %s of stream %q was pending in group %q before the group was lost and created again",
						adapters.ErrLeaseLost, ErrGroupMissing, id, s.stream, s.group)
					break
				}
				failed[i] = fmt.Errorf("%w: entry %s is no longer pending in group %q of stream %q (another consumer claimed and acked it, or the group was created again)",
					adapters.ErrLeaseLost, id, s.group, s.stream)
			}
		case string:
			s.stats.leaseLost.Add(1)
			failed[i] = fmt.Errorf("%w: entry %s of stream %q was claimed by consumer %q after it was idle for the lease",
				adapters.ErrLeaseLost, id, s.stream, r)
		default:
			failed[i] = fmt.Errorf("redisstream: unexpected %s result %v for entry %s", op, r, id)
		}
	}
	return nil
}

// lostWithGroup reports whether d was received before this Source last found
// the group missing.
func (s *Source) lostWithGroup(d *adapters.Delivery) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.groupLost.IsZero() && d.ReceivedAt.Before(s.groupLost)
}

// deletedWhileHeld records that a held entry was found deleted from the
// stream: it is not renewed again, and its handler runs on.
func (s *Source) deletedWhileHeld(id string) {
	s.mu.Lock()
	if s.gone == nil {
		s.gone = make(map[string]struct{})
	}
	_, known := s.gone[id]
	if !known && len(s.gone) < maxTracked {
		s.gone[id] = struct{}{}
	}
	s.mu.Unlock()
	if known {
		return
	}
	s.stats.deletedWhileHeld.Add(1)
	s.tel.deleted.Add(context.Background(), 1, s.tel.base)
	s.logger.Warn("redisstream: an entry was deleted from the stream (trimmed, or XDEL) while this consumer held it; its handler runs on, and its ack will find nothing to acknowledge",
		"stream", s.stream, "group", s.group, "id", id)
}

// Nack gives the entries back, each to be claimable by any consumer's
// reclaim no sooner than its After from now (zero or less: at once), in one
// script call; see Retries in the package documentation. Entries claimed by
// another consumer, or no longer pending, fail with an error wrapping
// adapters.ErrLeaseLost, and entries deleted from the stream with one
// wrapping ErrDeleted. An entry a DeadLetter acknowledged with its copy
// succeeds without a command.
func (s *Source) Nack(ctx context.Context, ns []adapters.Nack) error {
	ds := make([]*adapters.Delivery, len(ns))
	for i, n := range ns {
		ds[i] = n.Delivery
	}
	s.unhold(ds)
	return s.nack(ctx, ds, func(i int) time.Duration { return ns[i].After }, false)
}

// maxDelay caps a Nack's delay, so that due times stay well within the
// range of the sorted set's scores and of the key's expiry.
const maxDelay = 100 * 365 * 24 * time.Hour

// nack gives ds[i] back after delay(i). With undeliver, the delivery count
// goes back down by one: the entries were read but never handed out.
func (s *Source) nack(ctx context.Context, ds []*adapters.Delivery, delay func(i int) time.Duration, undeliver bool) error {
	if len(ds) == 0 {
		return nil
	}
	args := make([]any, 0, 4+3*len(ds))
	args = append(args, s.group, s.consumer, s.opts.lease.Milliseconds(), flag(undeliver))
	idx := make([]int, 0, len(ds))
	delays := make([]time.Duration, len(ds))
	failed := map[int]error{}
	for i, d := range ds {
		switch {
		case !s.owns(d):
			failed[i] = s.foreign(d)
		case isDeadLettered(d):
			// Acknowledged by its dead letter: delivered no more.
		case s.isGone(d.ID):
			failed[i] = fmt.Errorf("%w: entry %s of stream %q", ErrDeleted, d.ID, s.stream)
		default:
			delays[i] = min(max(delay(i), 0), maxDelay)
			args = append(args, d.ID, heldOf(d).count, int64(math.Ceil(float64(delays[i])/float64(time.Millisecond))))
			idx = append(idx, i)
		}
	}
	if len(idx) > 0 {
		s.count(cmdNack)
		sent := time.Now()
		res, err := nackScript.Run(ctx, s.client, []string{s.stream, s.delays}, args...).Slice()
		s.conn.observe(sent, err)
		now := time.Now()
		err = s.settled(cmdNack, ds, idx, res, err, failed, func(i int) {
			s.stats.nacked.Add(1)
			if delays[i] > s.opts.lease {
				s.stats.parked.Add(1)
			}
			s.track(ds[i].ID, now.Add(delays[i]))
		})
		if err != nil {
			return err
		}
	}
	if len(failed) > 0 {
		return &adapters.BatchError{Failed: failed}
	}
	return nil
}
