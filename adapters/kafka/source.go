package kafka

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

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

// Capabilities implements adapters.Source. By key, a record queued behind
// its key's running one costs the broker nothing and the unacked bounds
// hold it (FreeWhileQueued: see the package documentation, section
// Ordering); by partition the Source shares the runtime's window out over
// the partitions itself, from what the runtime holds, so every record
// handed out stays in that window.
func (s *Source) Capabilities() adapters.Capabilities {
	return adapters.Capabilities{
		Name:            s.name,
		System:          "kafka",
		Ordered:         s.cfg.ordering != Unordered,
		MaxUnacked:      s.cfg.maxTotal,
		FreeWhileQueued: s.cfg.ordering == ByKey,
	}
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
