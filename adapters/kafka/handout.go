package kafka

import (
	"context"
	"strconv"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kgo"
)

// heldSlab is how many held values one allocation makes. Any size works:
// it is not fitted to the allocator's size classes.
const heldSlab = 64

// strChunk is the size of the buffers that delivery strings are cut from;
// strings longer than maxSharedStr get their own allocation, so that a small
// string kept alive does not pin a large buffer, nor a large one a chunk.
const (
	strChunk     = 4096
	maxSharedStr = 256
)

// setLaneCapLocked bounds, by partition, the records of one partition
// handed out at once to its share of what the runtime holds now plus the
// want it asks for, over the live partitions (see the package
// documentation, section Ordering). At least two, so that a partition's
// next record waits in the runtime when its record ends.
func (s *Source) setLaneCapLocked(want int) {
	if s.cfg.ordering != ByPartition {
		return
	}
	live := 0
	for _, p := range s.order {
		if !p.fenced && !p.draining {
			live++
		}
	}
	live = max(live, 1)
	s.laneCap = max(2, (s.totalHeld+want+live-1)/live)
}

// cappedLocked reports whether p has as many records handed out as the
// lane cap allows.
func (s *Source) cappedLocked(p *partition) bool { return s.laneCap > 0 && p.nheld >= s.laneCap }

// takeLocked hands out ready records up to limit and the unacked bounds,
// shared out evenly over the partitions with records waiting.
func (s *Source) takeLocked(out []*adapters.Delivery, limit int) []*adapters.Delivery {
	n := len(s.order)
	if n == 0 {
		return out
	}
	if out == nil {
		out = make([]*adapters.Delivery, 0, min(limit, 256))
	}
	now := time.Now()
	for len(out) < limit {
		waiting := 0
		for _, p := range s.order {
			if p.backlogLen() > 0 && !s.cappedLocked(p) {
				waiting++
			}
		}
		if waiting == 0 {
			break
		}
		share := max(1, (limit-len(out))/waiting)
		progress := false
		for i := 0; i < n && len(out) < limit; i++ {
			p := s.order[(s.rr+i)%n]
			if p.backlogLen() == 0 || s.cappedLocked(p) {
				continue
			}
			before := len(out)
			out = s.takeFromLocked(p, out, min(limit, len(out)+share), now)
			progress = progress || len(out) > before || p.skippedSome
			p.skippedSome = false
		}
		if !progress {
			break
		}
	}
	s.rr = (s.rr + 1) % n
	return out
}

// takeFromLocked hands out p's next ready records until out holds max.
// Records a previous owner finished (per the commit metadata) are marked done
// on the way without being handed out.
func (s *Source) takeFromLocked(p *partition, out []*adapters.Delivery, max int, now time.Time) []*adapters.Delivery {
	if p.fenced || p.draining {
		return out
	}
	for len(out) < max && len(p.requeue) > 0 && s.totalHeld < s.cfg.maxTotal && !s.cappedLocked(p) {
		h := p.requeue[0]
		p.requeue[0] = nil
		p.requeue = p.requeue[1:]
		h.d.ReceivedAt = now
		p.hold(h)
		s.totalHeld++
		out = append(out, &h.d)
	}
	for len(out) < max && p.backHead < len(p.backlog) {
		if p.nheld >= s.cfg.maxPerPart || s.totalHeld >= s.cfg.maxTotal || s.cappedLocked(p) {
			break
		}
		r := p.backlog[p.backHead]
		c := p.trackCost(r.Offset, r.LeaderEpoch)
		if !p.fits(c, s.cfg.metadataLimit) {
			break // the metadata could not record more: wait for the prefix
		}
		p.backlog[p.backHead] = nil
		p.backHead++
		s.totalBack--
		p.track(r.Offset, r.LeaderEpoch, c)
		// Asked of markers too: a marker of a later epoch also tells that
		// the inherited spans name records of another log.
		skip := p.skipped(r.Offset, r.LeaderEpoch)
		if r.Attrs.IsControl() { // a transaction marker: nothing to run, but done
			p.done(r.Offset)
			p.skippedSome = true
			continue
		}
		if skip {
			p.done(r.Offset)
			p.skippedSome = true
			s.tel.skipped.Add(context.Background(), 1, s.tel.partAttrs(p))
			continue
		}
		h := s.newHeld(p, r, now)
		p.hold(h)
		s.totalHeld++
		out = append(out, &h.d)
	}
	if p.backHead == len(p.backlog) {
		p.backlog, p.backHead = p.backlog[:0], 0
	}
	s.updatePauseLocked(p)
	return out
}

// newHeld builds the delivery for r. Called under s.mu.
func (s *Source) newHeld(p *partition, r *kgo.Record, now time.Time) *held {
	h := s.allocHeldLocked(p)
	d := &h.d
	d.Signal = &h.sig
	// "topic/partition/offset"; the lane of a partition is its prefix.
	var num [20]byte
	off := strconv.AppendInt(num[:0], r.Offset, 10)
	d.ID = s.str(p.lane, off)
	if len(r.Key) > 0 {
		if s.cfg.ordering == ByKey {
			// "topic/partition/key": the key is its suffix.
			d.OrderingKey = s.str(p.lane, r.Key)
			d.Key = d.OrderingKey[len(p.lane)+1:]
		} else {
			d.Key = s.str("", r.Key)
		}
	}
	d.Body = r.Value
	if len(r.Headers) > 0 {
		d.Headers = make(map[string]string, len(r.Headers))
		for _, rh := range r.Headers {
			d.Headers[rh.Key] = s.str("", rh.Value)
		}
	}
	d.Queue = r.Topic
	d.Partition = r.Partition
	d.Offset = r.Offset
	d.PublishedAt = r.Timestamp
	d.ReceivedAt = now
	d.Native = r
	d.Handle = h
	switch s.cfg.ordering {
	case ByPartition:
		d.OrderingKey = p.lane
	case ByKey:
		if len(r.Key) == 0 {
			d.OrderingKey = p.lane // keyless records share the partition's lane
		}
	}
	return h
}

// redeliveryLocked returns the delivery that hands out h's record again
// after a nack: a copy of h's delivery with a Signal and a Handle of its own,
// so that nothing done to the nacked delivery (a Lose, a late Ack or Nack)
// reaches the redelivery. The nacked delivery stays nacked: an Ack of it
// fails with errNacked. Called under s.mu.
func (s *Source) redeliveryLocked(h *held) *held {
	r := s.allocHeldLocked(h.p)
	r.d = h.d
	r.d.Signal = &r.sig
	r.d.Handle = r
	return r
}

// allocHeldLocked returns a held value of p, not handed out, from the slab.
func (s *Source) allocHeldLocked(p *partition) *held {
	if len(s.slab) == 0 {
		s.slab = make([]held, heldSlab)
	}
	h := &s.slab[0]
	s.slab = s.slab[1:]
	h.p, h.slot = p, -1
	return h
}

// str returns b as a string, prefixed with prefix and '/' unless prefix is
// empty, cut from s.strs unless longer than maxSharedStr. Called under s.mu.
func (s *Source) str(prefix string, b []byte) string {
	n := len(b)
	if prefix != "" {
		n += len(prefix) + 1
	}
	switch {
	case n == 0:
		return ""
	case n > maxSharedStr && prefix == "":
		return string(b)
	case n > maxSharedStr:
		return prefix + "/" + string(b) // one allocation
	}
	sb := &s.strs
	if sb.Cap()-sb.Len() < n {
		sb.Reset() // the strings cut from the old buffer keep it alive
		sb.Grow(strChunk)
	}
	start := sb.Len()
	if prefix != "" {
		sb.WriteString(prefix)
		sb.WriteByte('/')
	}
	sb.Write(b)
	return sb.String()[start:]
}
