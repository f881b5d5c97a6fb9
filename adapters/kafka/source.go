package kafka

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Source consumes a consumer group's topics and hands records to the custody
// runtime. It implements adapters.Source. Create it with New.
type Source struct {
	cfg  config
	cl   *kgo.Client
	tel  *telemetry
	name string
	conn *connWatch
	// readCommitted: the client reads committed records only, and lag
	// counts to the last stable offset.
	readCommitted bool

	mu        sync.Mutex
	parts     map[tpKey]*partition
	order     []*partition // assigned partitions, for round-robin hand-out
	rr        int
	epoch     uint64
	totalHeld int
	totalBack int
	closing   bool
	closed    bool
	// wake is signalled when capacity frees up or records become ready.
	wake chan struct{}
	// pollCancel interrupts a poll in progress so that a Receive waiting on
	// the broker notices records that became ready in a backlog.
	pollCancel context.CancelFunc
	// slab hands out held values allocated heldSlab at a time (one
	// allocation per record shows in the runtime's per-record cost). A held
	// value kept alive keeps its slab alive.
	slab []held
	// strs holds the bytes of the deliveries' strings (IDs, keys, ordering
	// keys, headers), strChunk at a time. Bytes written are never changed:
	// a Builder only appends, and Reset starts a new buffer.
	strs strings.Builder
	// laneCap is, by partition, the most records of one partition handed
	// out at once (see setLaneCapLocked); 0 in the other scopes.
	laneCap int
	// released lists the partitions an Ack or Nack released deliveries of
	// (see settleLocked).
	released     []*partition
	intakePaused bool     // between Pause and Resume
	pausedTopics []string // the topics Pause paused in the client
	// pauseMu orders Pause and Resume, so that the client's topic pauses
	// end as the last call left them.
	pauseMu sync.Mutex

	// commitMu serialises building and sending commits, so a commit built
	// before a fence is never sent after the revoke's own commit.
	commitMu sync.Mutex
	// pollSem lets one poll at a time run, from PollRecords to
	// AllowRebalance: AllowRebalance releases every poll at once, so a
	// concurrent poll's records could be booked under the partition's next
	// assignment.
	pollSem chan struct{}

	stopLoop   chan struct{}
	loopDone   chan struct{}
	lagDone    chan struct{} // closed when lagLoop returns
	stopLag    context.CancelFunc
	commitSoon chan struct{} // commit before the next tick
	marked     chan struct{} // records were marked done: commit a linger later
	recalls    chan struct{} // see Recalls
	closeErr   error
	once       sync.Once
}

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

type tpKey struct {
	topic string
	part  int32
}

// New creates a Source and its franz-go client, and reaches the cluster
// within ctx: it fails, with the cause, when none of the brokers answers (not
// reachable, TLS or SASL refused) before ctx ends. The client joins the group
// when the Source is first polled. Later connection trouble does not fail the
// Source (see the package documentation).
func New(ctx context.Context, opts ...Option) (*Source, error) {
	cfg, err := apply(opts)
	if err != nil {
		return nil, err
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Source{
		cfg:        cfg,
		name:       "kafka:" + strings.Join(cfg.topics, ","),
		parts:      make(map[tpKey]*partition),
		wake:       make(chan struct{}, 1),
		stopLoop:   make(chan struct{}),
		loopDone:   make(chan struct{}),
		lagDone:    make(chan struct{}),
		commitSoon: make(chan struct{}, 1),
		marked:     make(chan struct{}, 1),
		recalls:    make(chan struct{}, 1),
		pollSem:    make(chan struct{}, 1),
		conn:       newConnWatch(cfg.logger, "source of group "+cfg.group),
	}
	tel, err := newTelemetry(cfg.meterProvider, cfg.group, s)
	if err != nil {
		return nil, fmt.Errorf("kafka: telemetry: %w", err)
	}
	s.tel = tel
	cl, err := cfg.connect(ctx, "", cfg.kgoOpts(s.conn,
		kgo.ConsumerGroup(cfg.group),
		kgo.ConsumeTopics(cfg.topics...),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		// Markers are marked done like records, so that the commit reaches
		// the end of a transactional producer's partition.
		kgo.KeepControlRecords(),
		kgo.OnPartitionsAssigned(s.onAssigned),
		kgo.OnOffsetsFetched(s.onOffsetsFetched),
		kgo.OnPartitionsRevoked(s.onRevoked),
		kgo.OnPartitionsLost(s.onLost),
		// A dead-letter sink made from the Source (Source.NewDeadLetter)
		// produces through this client, as one made alone would.
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.ProducerLinger(0),
	))
	if err != nil {
		tel.close()
		return nil, err
	}
	s.cl = cl
	s.readCommitted = readsCommitted(cl)
	go s.commitLoop()
	lagCtx, stopLag := context.WithCancel(context.Background())
	s.stopLag = stopLag
	go s.lagLoop(lagCtx)
	return s, nil
}

// Client returns the franz-go client, for admin calls and inspection. Do not
// poll, commit or close it: the Source owns those.
func (s *Source) Client() *kgo.Client { return s.cl }

// Recalls implements adapters.Recaller: it is signalled when a revoke
// recalled handed-out records (see the package documentation, section
// Rebalances).
func (s *Source) Recalls() <-chan struct{} { return s.recalls }

// Capabilities implements adapters.Source.
func (s *Source) Capabilities() adapters.Capabilities {
	return adapters.Capabilities{
		Name:       s.name,
		System:     "kafka",
		Ordered:    s.cfg.ordering != Unordered,
		MaxUnacked: s.cfg.maxTotal,
	}
}

// Receive implements adapters.Source: it hands out polled records, up to the
// unacked bounds, waiting at most the poll wait for new ones. A
// partition's fetch error (a data loss, a topic not authorised) is returned
// along with the records of the other partitions. Concurrent calls poll one
// at a time.
func (s *Source) Receive(ctx context.Context, want int) ([]*adapters.Delivery, error) {
	if want < 1 {
		want = 1
	}
	s.mu.Lock()
	if s.closed || s.closing {
		s.mu.Unlock()
		return nil, adapters.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		// Handed out now, backlog records would start handlers after the
		// runtime began to shut down.
		s.mu.Unlock()
		return nil, err
	}
	s.setLaneCapLocked(want)
	out := s.takeLocked(nil, want)
	room := s.cfg.maxTotal - s.totalHeld
	s.mu.Unlock()
	if len(out) > 0 {
		return out, nil
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if room <= 0 {
		return s.waitForRoom(ctx, want)
	}
	return s.poll(ctx, want)
}

// waitForRoom waits, up to the poll wait, for acks to free capacity.
func (s *Source) waitForRoom(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	t := time.NewTimer(s.cfg.pollWait)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-t.C:
	case <-s.wake:
	}
	s.mu.Lock()
	out := s.takeLocked(nil, max)
	s.mu.Unlock()
	return out, nil
}

// poll takes every record the client has fetched, waiting up to the poll
// wait for some, into the partitions' backlogs, and hands out up to max.
// Every record, not n: see the package documentation, section Backpressure.
func (s *Source) poll(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	var out []*adapters.Delivery
	select {
	case s.pollSem <- struct{}{}:
	default:
		// Another Receive is polling (see pollSem): wait for it, then hand
		// out what it booked before polling again.
		select {
		case s.pollSem <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		s.mu.Lock()
		out = s.takeLocked(nil, max)
		s.mu.Unlock()
		if len(out) > 0 {
			<-s.pollSem
			return out, nil
		}
	}
	defer func() { <-s.pollSem }()
	pctx, cancel := context.WithTimeout(ctx, s.cfg.pollWait)
	s.mu.Lock()
	s.pollCancel = cancel
	s.mu.Unlock()
	fs := s.cl.PollRecords(pctx, 0)
	s.mu.Lock()
	s.pollCancel = nil
	refetch, lose, notices := s.registerLocked(fs)
	out = s.takeLocked(nil, max)
	s.mu.Unlock()
	cancel()
	for _, h := range lose {
		h.sig.Lose(ErrRewound)
	}
	if len(refetch) > 0 {
		// Before AllowRebalance, as franz-go asks: no revoke runs meanwhile.
		s.cl.SetOffsets(refetch)
	}
	// The records are booked under their epoch: a rebalance may proceed.
	s.cl.AllowRebalance()
	ferr := errors.Join(fetchError(fs), notices)
	if len(out) > 0 {
		return out, ferr // a partition's error must not hide behind others' records
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if fs.IsClientClosed() {
		return nil, adapters.ErrClosed
	}
	return nil, ferr
}

// fetchError returns the first error of fs that is not a poll's own context
// ending, or nil.
func fetchError(fs kgo.Fetches) error {
	var ferr error
	fs.EachError(func(topic string, part int32, err error) {
		if ferr == nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, kgo.ErrClientClosed) {
			ferr = fmt.Errorf("kafka: fetching %s/%d: %w", topic, part, err)
		}
	})
	return ferr
}

// readsCommitted reports whether cl reads committed records only. franz-go
// reports the isolation level as the protocol's number, 1 for
// READ_COMMITTED.
func readsCommitted(cl *kgo.Client) bool {
	switch v := cl.OptValue(kgo.FetchIsolationLevel).(type) {
	case int8:
		return v == 1
	case kgo.IsolationLevel:
		return v == kgo.ReadCommitted()
	}
	return false
}

// hasRecords reports whether fs holds records of topic/part.
func hasRecords(fs kgo.Fetches, topic string, part int32) bool {
	found := false
	fs.EachPartition(func(fp kgo.FetchTopicPartition) {
		found = found || (fp.Topic == topic && fp.Partition == part && len(fp.Records) > 0)
	})
	return found
}

// registerLocked appends polled records to their partitions' backlogs.
// Records of partitions no longer assigned (or assigned anew since the fetch)
// are dropped: their current owner reads them from the committed offset.
// It returns, for partitions rewound after a data loss (see rewindLocked),
// the offsets to fetch again from (for SetOffsets) and the records in
// flight to lose outside the lock; and the records deleted before the group
// read them (see expiredLocked), for Receive to report.
func (s *Source) registerLocked(fs kgo.Fetches) (refetch map[string]map[int32]kgo.EpochOffset, lose []*held, notices error) {
	// Data losses first. franz-go appends its data-loss notices after a
	// poll's records, and fetches from the rewind point at once: a late poll
	// (the runtime busy, the unacked bound reached) holds records read from
	// the rewind point before the notice. Registered first, those would pass
	// for records already polled and be dropped (never to be fetched again),
	// or move lastPolled past the reset point and fake a rewind below them.
	fs.EachError(func(topic string, part int32, err error) {
		var loss *kgo.ErrDataLoss
		if !errors.As(err, &loss) {
			return
		}
		p := s.parts[tpKey{topic, part}]
		if _, again := refetch[topic][part]; p == nil || p.fenced || p.draining || again || loss.ResetTo > p.lastPolled {
			return
		}
		var from int64
		p, from, lose = s.rewindLocked(p, loss.ResetTo, lose)
		if from < loss.ResetTo || hasRecords(fs, topic, part) {
			// Records between from and the reset point were polled but
			// not all done, or this poll holds records of the partition
			// that may be the old log's as well as the new one's (fetched
			// before the rewind, and buffered): fetch from from again, in
			// the new log's order, and ignore what this poll holds.
			if refetch == nil {
				refetch = map[string]map[int32]kgo.EpochOffset{}
			}
			if refetch[topic] == nil {
				refetch[topic] = map[int32]kgo.EpochOffset{}
			}
			refetch[topic][part] = kgo.EpochOffset{Epoch: -1, Offset: from}
		}
		s.updatePauseLocked(p) // the old epoch may have been paused
	})
	fs.EachPartition(func(fp kgo.FetchTopicPartition) {
		p := s.parts[tpKey{fp.Topic, fp.Partition}]
		if _, again := refetch[fp.Topic][fp.Partition]; p == nil || p.fenced || p.draining || again {
			return
		}
		if fp.Err == nil && fp.HighWatermark >= 0 {
			// franz-go's own notices (data loss, a topic not authorised)
			// carry a zero, not a high watermark. Read committed, the end
			// is the last stable offset (see listEnds).
			p.hwm, p.hwmAt = fp.HighWatermark, time.Now()
			if s.readCommitted && fp.LastStableOffset >= 0 {
				p.hwm = fp.LastStableOffset
			}
		}
		if p.lastPolled < 0 && len(fp.Records) > 0 {
			if fp.Records[0].Offset < p.committed {
				// Fetching started below the committed offset (the log
				// was truncated or recreated, and the client reset): the
				// done offsets in the commit metadata describe other
				// records.
				p.skip = nil
			}
			notices = errors.Join(notices, s.expiredLocked(p, fp.Records[0].Offset, fp.LogStartOffset))
		}
		for _, r := range fp.Records {
			if r.Offset <= p.lastPolled {
				continue // already polled: a refetch, not new records
			}
			p.lastPolled = r.Offset
			p.backlog = append(p.backlog, r)
			s.totalBack++
		}
		s.updatePauseLocked(p)
	})
	return refetch, lose, notices
}

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

// updatePauseLocked pauses fetching a partition whose backlog and
// handed-out records reach its bound, and resumes it below the bound.
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

// Ack implements adapters.Source: it marks the records done, in process; the
// commit follows (see the package documentation, section Commits). Records
// whose partition was revoked or lost fail with adapters.ErrRevoked: their
// new owner runs them. A record nacked already fails too (it is handed out
// again); acking a record twice is no error.
func (s *Source) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	var failed map[int]error
	marked := false
	s.mu.Lock()
	for i, d := range ds {
		h, ok := d.Handle.(*held)
		if !ok {
			failed = addFailure(failed, i, errForeign)
			continue
		}
		p := h.p
		if p.fenced {
			failed = addFailure(failed, i, adapters.ErrRevoked)
			continue
		}
		if h.slot == slotNacked {
			// Handed out again (or left to the next owner): nil would
			// promise a commit that does not happen.
			failed = addFailure(failed, i, errNacked)
			continue
		}
		if h.slot < 0 {
			continue // acked twice
		}
		s.releaseLocked(p, h)
		p.done(h.d.Offset)
		marked = true
	}
	if marked {
		notify(s.marked)
	}
	s.settleLocked()
	s.mu.Unlock()
	if failed != nil {
		return &adapters.BatchError{Failed: failed}
	}
	return nil
}

// Nack implements adapters.Source. Kafka has no delayed redelivery: the
// record is not marked done, so its offset is not committed, and it is handed
// out again by a later Receive, as a new Delivery with a Signal of its own
// (the nacked one stays nacked: acking it fails). At shutdown this leaves it
// uncommitted for the partition's next owner.
func (s *Source) Nack(ctx context.Context, ns []adapters.Nack) error {
	var failed map[int]error
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, n := range ns {
		h, ok := n.Delivery.Handle.(*held)
		if !ok {
			failed = addFailure(failed, i, errForeign)
			continue
		}
		if h.p.fenced || h.slot < 0 {
			continue
		}
		s.releaseLocked(h.p, h)
		h.slot = slotNacked
		if !s.closing {
			h.p.requeue = append(h.p.requeue, s.redeliveryLocked(h))
		}
	}
	s.settleLocked()
	if failed != nil {
		return &adapters.BatchError{Failed: failed}
	}
	return nil
}

// releaseLocked removes h from its partition's in-flight records. The caller
// calls settleLocked once it has released all it will.
func (s *Source) releaseLocked(p *partition, h *held) {
	p.unhold(h)
	s.totalHeld--
	if !p.released {
		p.released = true
		s.released = append(s.released, p)
	}
}

// settleLocked, once per Ack or Nack, ends the revoke drains now complete,
// updates the pauses, and wakes whoever waits for capacity or records.
func (s *Source) settleLocked() {
	if len(s.released) == 0 {
		return
	}
	ready := false
	for i, p := range s.released {
		s.released[i] = nil
		p.released = false
		if p.drained != nil && p.nheld == 0 {
			close(p.drained)
			p.drained = nil
		}
		s.updatePauseLocked(p)
		ready = ready || (p.backlogLen() > 0 && !s.cappedLocked(p))
	}
	s.released = s.released[:0]
	notify(s.wake)
	if s.pollCancel != nil && ready {
		s.pollCancel() // records are ready now; stop waiting on the broker
		s.pollCancel = nil
	}
}

var (
	// errNacked fails an Ack of a record already nacked.
	errNacked  = errors.New("kafka: the record was nacked already; it is handed out again, not committed")
	errForeign = errors.New("kafka: the delivery does not come from this Source")
)

func addFailure(m map[int]error, i int, err error) map[int]error {
	if m == nil {
		m = make(map[int]error)
	}
	m[i] = err
	return m
}

// Close implements adapters.Source: it commits the done prefixes, leaves the
// group and closes the client. Records still held are given up (their
// contexts are cancelled with adapters.ErrClosed) and stay uncommitted.
func (s *Source) Close() error {
	s.once.Do(func() {
		s.conn.close()
		s.mu.Lock()
		s.closing = true
		var lose []*held
		for _, p := range s.order {
			p.eachHeld(func(h *held) { lose = append(lose, h) })
			if p.drained != nil { // a revoke waiting for them need not wait on
				close(p.drained)
				p.drained = nil
			}
		}
		s.mu.Unlock()
		for _, h := range lose {
			h.sig.Lose(adapters.ErrClosed)
		}
		close(s.stopLoop)
		s.stopLag()
		<-s.loopDone
		<-s.lagDone
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.commitTimeout)
		s.closeErr = s.commit(ctx, nil)
		cancel()
		// Leaving the group runs onRevoked, which fences every partition
		// (the commit above left it nothing new to commit).
		s.cl.CloseAllowingRebalance()
		s.mu.Lock()
		s.closed = true
		s.mu.Unlock()
		s.tel.close()
	})
	return s.closeErr
}
