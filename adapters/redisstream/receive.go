package redisstream

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/adapters"
)

// ErrGroupMissing is wrapped by the errors the Source returns when the
// consumer group no longer exists: the stream was deleted, or the server
// restarted without persistence. Entries the group held pending, and those
// this Source held, are gone with it.
var ErrGroupMissing = errors.New("redisstream: the consumer group does not exist")

// Receive returns up to max entries: first, when a reclaim is due (a retry
// this Source gave back fell due, or WithReclaimInterval passed since the
// last scan), those idle past the lease, then new ones (XREADGROUP ...
// STREAMS stream >) for the room left; see Reclaim in the package
// documentation. So reclaimed entries go ahead of new ones, and a steady
// flow of new entries cannot starve them; a scan takes at most max entries
// (and 256), so a large backlog of them is taken one scan per Receive.
//
// It blocks for at most WithBlock (less when a reclaim falls due sooner)
// and returns no entries and a nil error when nothing came. After ctx is
// done or Close, it gives back what a call under way still read (with its
// delivery count as it was) and returns ctx's error or adapters.ErrClosed.
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
	var (
		out []*adapters.Delivery
		err error
		gen = s.generation()
	)
	if job, ok := s.takeReclaim(time.Now(), min(max, maxReclaim)); ok {
		out, err = s.reclaim(ctx, gen, job, min(max, maxReclaim))
	}
	if err == nil && len(out) < max {
		block := time.Duration(-1) // none: there is something to hand out already
		if len(out) == 0 {
			block = s.blockFor(time.Now())
		}
		var ds []*adapters.Delivery
		ds, err = s.read(ctx, gen, max-len(out), block)
		out = append(out, ds...)
	}
	if closed := s.isClosed(); closed || ctx.Err() != nil {
		s.release(out)
		if closed {
			return nil, adapters.ErrClosed
		}
		return nil, ctx.Err()
	}
	s.hold(out)
	return out, err
}

// maxReclaim bounds the entries one reclaim claims: each XAUTOCLAIM call of
// the script scans up to ten times that many pending entries, and the
// script holds the server while it runs.
const maxReclaim = 256

// reclaimJob is what one Receive reclaims: entries this Source gave back
// that fell due, and whether it scans the pending list, from cursor.
type reclaimJob struct {
	ids    []string
	scan   bool
	cursor string
}

// takeReclaim returns the reclaim due at now, if any: up to max given-back
// entries due, and a scan when one is due and no other Receive is scanning.
func (s *Source) takeReclaim(now time.Time, max int) (reclaimJob, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var job reclaimJob
	for len(s.due) > 0 && !s.due[0].at.After(now) && len(job.ids) < max {
		job.ids = append(job.ids, heap.Pop(&s.due).(dueEntry).id)
	}
	if !s.scanning && !now.Before(s.nextScan) {
		job.scan, job.cursor = true, s.cursor
		s.scanning = true
	}
	return job, job.scan || len(job.ids) > 0
}

// blockFor is how long a read may block at now: WithBlock, or less when a
// reclaim falls due sooner; -1 for a read that does not block.
func (s *Source) blockFor(now time.Time) time.Duration {
	s.mu.Lock()
	wait := s.opts.block
	if d := s.nextScan.Sub(now); d < wait {
		wait = d
	}
	if len(s.due) > 0 {
		if d := s.due[0].at.Sub(now); d < wait {
			wait = d
		}
	}
	s.mu.Unlock()
	switch {
	case wait <= 0:
		return -1
	case wait < time.Millisecond:
		return time.Millisecond // BLOCK counts whole milliseconds; 0 would block for ever
	}
	return wait.Truncate(time.Millisecond)
}

// reclaim runs reclaimScript for job and returns what it claimed.
func (s *Source) reclaim(ctx context.Context, gen uint64, job reclaimJob, max int) ([]*adapters.Delivery, error) {
	cursor := job.cursor
	if cursor == "" {
		cursor = "0-0"
	}
	args := make([]any, 0, 6+len(job.ids))
	args = append(args, s.group, s.consumer, s.opts.lease.Milliseconds(), cursor, max, flag(job.scan))
	for _, id := range job.ids {
		args = append(args, id)
	}
	s.count(cmdReclaim)
	sent := time.Now()
	res, err := reclaimScript.Run(ctx, s.client, []string{s.stream, s.delays}, args...).Slice()
	s.conn.observe(sent, err)
	now := time.Now()
	if err != nil {
		s.failed(cmdReclaim)
		s.reclaimDone(job, "", false, nil, now, err)
		if isNoGroup(err) {
			return nil, s.groupMissing(ctx, gen, err)
		}
		return nil, fmt.Errorf("redisstream: reclaiming idle entries of stream %q: %w", s.stream, err)
	}
	r, err := parseReclaim(res)
	if err != nil {
		s.reclaimDone(job, "", false, nil, now, err)
		return nil, err
	}
	s.reclaimDone(job, r.cursor, len(r.entries) >= max, r.later, now, nil)
	if len(r.deleted) > 0 {
		// XAUTOCLAIM drops every pending entry it finds deleted, this
		// Source's own held ones included: those were handed out, and
		// their handlers run on.
		pending, held := s.splitHeld(r.deleted)
		for _, id := range held {
			s.deletedWhileHeld(id)
		}
		if len(pending) > 0 {
			s.deletedWhilePending(pending)
		}
	}
	s.stats.parked.Add(r.parked)
	ds := make([]*adapters.Delivery, len(r.entries))
	hs := make([]held, len(r.entries))
	for i, e := range r.entries {
		ds[i] = s.delivery(&hs[i], e.msg, e.count, now)
	}
	if n := len(ds); n > 0 {
		s.stats.reclaimed.Add(int64(n))
		s.stats.received.Add(int64(n))
		s.tel.reclaimed.Add(context.Background(), int64(n), s.tel.base)
	}
	return ds, nil
}

// reclaimDone records the outcome of a reclaim: the scan's new cursor and
// when the next scan is due (at once when it came back full: more may
// wait), the given-back entries not due yet by the server's clock, and,
// after a failure, the given-back entries to try again.
func (s *Source) reclaimDone(job reclaimJob, cursor string, full bool, later []dueEntry, now time.Time, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if job.scan {
		s.scanning = false
		if err == nil {
			s.cursor = cursor
		}
		s.nextScan = now.Add(s.interval)
		if err == nil && full {
			s.nextScan = now
		}
	}
	for _, e := range later {
		heap.Push(&s.due, e)
	}
	if err != nil && !isNoGroup(err) {
		for _, id := range job.ids {
			heap.Push(&s.due, dueEntry{id: id, at: now.Add(s.interval)})
		}
	}
}

// reclaimed is reclaimScript's answer.
type reclaimed struct {
	cursor  string
	entries []claimedEntry
	deleted []string
	later   []dueEntry
	parked  int64
}

type claimedEntry struct {
	msg   redis.XMessage
	count int
}

func parseReclaim(res []any) (reclaimed, error) {
	var r reclaimed
	bad := func(what string) (reclaimed, error) {
		return reclaimed{}, fmt.Errorf("redisstream: unexpected answer from the reclaim script (%s): %v", what, res)
	}
	if len(res) != 5 {
		return bad("length")
	}
	var ok bool
	if r.cursor, ok = res[0].(string); !ok {
		return bad("cursor")
	}
	entries, _ := res[1].([]any)
	for _, e := range entries {
		f, ok := e.([]any)
		if !ok || len(f) != 3 {
			return bad("entry")
		}
		id, ok1 := f[0].(string)
		count, ok2 := f[1].(int64)
		fields, ok3 := f[2].([]any)
		if !ok1 || !ok2 || !ok3 || len(fields)%2 != 0 {
			return bad("entry")
		}
		values := make(map[string]any, len(fields)/2)
		for i := 0; i < len(fields); i += 2 {
			k, _ := fields[i].(string)
			values[k] = fields[i+1]
		}
		r.entries = append(r.entries, claimedEntry{msg: redis.XMessage{ID: id, Values: values}, count: int(count)})
	}
	deleted, _ := res[2].([]any)
	for _, d := range deleted {
		if id, ok := d.(string); ok {
			r.deleted = append(r.deleted, id)
		}
	}
	later, _ := res[3].([]any)
	now := time.Now()
	for i := 0; i+1 < len(later); i += 2 {
		id, ok1 := later[i].(string)
		ms, ok2 := later[i+1].(int64)
		if ok1 && ok2 {
			r.later = append(r.later, dueEntry{id: id, at: now.Add(time.Duration(ms) * time.Millisecond)})
		}
	}
	r.parked, _ = res[4].(int64)
	return r, nil
}

// read reads up to n new entries, blocking for block (-1: not at all).
func (s *Source) read(ctx context.Context, gen uint64, n int, block time.Duration) ([]*adapters.Delivery, error) {
	s.count(cmdRead)
	sent := time.Now()
	res, err := s.client.XReadGroup(ctx, &redis.XReadGroupArgs{
		Group:    s.group,
		Consumer: s.consumer,
		Streams:  []string{s.stream, ">"},
		Count:    int64(n),
		Block:    block,
	}).Result()
	s.conn.observe(sent, err)
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	if err != nil {
		s.failed(cmdRead)
		if isNoGroup(err) {
			return nil, s.groupMissing(ctx, gen, err)
		}
		return nil, fmt.Errorf("redisstream: XREADGROUP on stream %q: %w", s.stream, err)
	}
	now := time.Now()
	n = 0
	for _, st := range res {
		n += len(st.Messages)
	}
	ds := make([]*adapters.Delivery, 0, n)
	hs := make([]held, n)
	for _, st := range res {
		for _, m := range st.Messages {
			ds = append(ds, s.delivery(&hs[len(ds)], m, 1, now))
		}
	}
	s.stats.received.Add(int64(len(ds)))
	return ds, nil
}

// groupMissing handles a NOGROUP answer to a command sent in generation
// gen of the group, as the package documentation says under A missing
// group; a Receive whose command found the group missing after another one
// handled it does nothing more.
func (s *Source) groupMissing(ctx context.Context, gen uint64, cause error) error {
	s.groupMu.Lock()
	defer s.groupMu.Unlock()
	s.mu.Lock()
	handled := s.gen != gen
	var lost []*held
	if !handled {
		lost = s.takeHeldLocked()
		s.cursor = "0-0"
		s.groupLost = time.Now()
	}
	s.mu.Unlock()
	if handled {
		if s.opts.createStart != "" {
			return nil
		}
		return fmt.Errorf("%w: stream %q, group %q; create the group again, or use WithCreateGroup: %w", ErrGroupMissing, s.stream, s.group, cause)
	}
	s.stats.groupMissing.Add(1)
	s.tel.groupMissing.Add(context.Background(), 1, s.tel.base)
	lostErr := fmt.Errorf("%w: %w: stream %q, group %q", adapters.ErrLeaseLost, ErrGroupMissing, s.stream, s.group)
	for _, h := range lost {
		h.sig.Lose(lostErr)
	}
	s.stats.leaseLost.Add(int64(len(lost)))
	defer s.nextGeneration()
	if s.opts.createStart == "" {
		return fmt.Errorf("%w: stream %q, group %q (the stream was deleted, or the server restarted without persistence); create the group again, or use WithCreateGroup: %w",
			ErrGroupMissing, s.stream, s.group, cause)
	}
	if err := s.createGroup(ctx, "0"); err != nil {
		return fmt.Errorf("%w: %w", ErrGroupMissing, err)
	}
	s.logger.Error("redisstream: the consumer group was missing (the stream was deleted, or the server restarted without persistence); it exists again, starting from the first entry of the stream. Entries pending in the old group are lost, and the handlers of those this consumer held were cancelled",
		"stream", s.stream, "group", s.group, "consumer", s.consumer, "held", len(lost))
	return nil
}

func (s *Source) generation() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.gen
}

func (s *Source) nextGeneration() {
	s.mu.Lock()
	s.gen++
	s.mu.Unlock()
}

// deletedWhilePending counts and logs entries a reclaim found deleted from
// the stream while pending. Redis dropped them from the pending list; they
// were never handed out.
func (s *Source) deletedWhilePending(ids []string) {
	n := int64(len(ids))
	s.stats.deleted.Add(n)
	s.tel.deleted.Add(context.Background(), n, s.tel.base)
	shown := ids
	if len(shown) > 10 {
		shown = shown[:10]
	}
	s.logger.Warn("redisstream: pending entries were deleted from the stream (trimmed, or XDEL) before they were handled; dropped from the pending list, not handed out",
		"stream", s.stream, "group", s.group, "entries", n, "ids", strings.Join(shown, ","))
}

// delivery fills h from an entry, handed out with delivery count attempt,
// and returns its Delivery.
func (s *Source) delivery(h *held, m redis.XMessage, attempt int, now time.Time) *adapters.Delivery {
	h.src, h.count = s, int64(attempt)
	h.d = adapters.Delivery{
		ID:          m.ID,
		Attempt:     attempt,
		Queue:       s.stream,
		Partition:   -1,
		Offset:      -1,
		PublishedAt: idTime(m.ID),
		ReceivedAt:  now,
		Native:      m,
		Handle:      h,
		Signal:      &h.sig,
	}
	d := &h.d
	n := len(m.Values)
	if _, ok := m.Values[s.opts.bodyField]; ok {
		n--
	}
	if n > 0 {
		d.Headers = make(map[string]string, n)
	}
	for k, v := range m.Values {
		str, _ := v.(string)
		if k == s.opts.bodyField {
			d.Body = []byte(str)
			continue
		}
		d.Headers[k] = str
	}
	return d
}

// idTime returns the time in an entry id made by XADD with "*" (its
// milliseconds part); the zero time for ids that cannot be one (before
// 2001: ids chosen by the producer).
func idTime(id string) time.Time {
	ms, _, _ := strings.Cut(id, "-")
	n, err := strconv.ParseInt(ms, 10, 64)
	if err != nil || n < 978307200000 {
		return time.Time{}
	}
	return time.UnixMilli(n)
}

// release gives back entries read for a Receive that cannot hand them out
// (its context ended, or the Source closed), with their delivery count as
// it was before the read: any consumer's reclaim takes them at once.
func (s *Source) release(ds []*adapters.Delivery) {
	if len(ds) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	err := s.nack(ctx, ds, func(int) time.Duration { return 0 }, true)
	if err != nil {
		s.logger.Warn("redisstream: giving back entries read after the receive was cancelled failed; they come back once idle for the lease",
			"stream", s.stream, "group", s.group, "entries", len(ds), "error", err)
		return
	}
	s.stats.released.Add(int64(len(ds)))
}
