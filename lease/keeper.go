package lease

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"slices"
	"sync"
	"time"

	"github.com/custody-go/custody/adapters"
)

// ErrMaxHold is the cause (wrapping adapters.ErrLeaseLost) given to a delivery
// whose total hold time reached Config.MaxHold.
var ErrMaxHold = fmt.Errorf("%w: the delivery was held for the maximum processing time", adapters.ErrLeaseLost)

// Config configures a Keeper.
type Config struct {
	// Lease is the length each renewal extends a lease to. Required.
	Lease time.Duration
	// Fraction of Lease after which a lease is renewed. Default 1/3.
	Fraction float64
	// MaxBatch bounds the deliveries in one Extend call. Default 10.
	MaxBatch int
	// MaxHold caps the total time a delivery is held, counted from its
	// ReceivedAt. Zero means no cap.
	MaxHold time.Duration
	// Parallel bounds concurrent Extend calls. Default 4.
	Parallel int
	// Timeout bounds one Extend call. Default: the renewal interval. A call
	// also ends when the earliest lease it carries has no more than a
	// quarter of the renewal interval left (see Semantics).
	Timeout time.Duration
	// Renewed, when set, is called after each successful renewal batch with
	// the number of leases renewed. Retrying is called when n renewals
	// failed with err but their leases have time left, so they are tried
	// again. Lost is called for each delivery the keeper loses (at MaxHold,
	// or after a renewal failed for good); not for one the adapter loses by
	// itself, nor for one whose lease was stopped before the keeper lost
	// it. The delivery is lost (its Signal.Lose has returned) before its
	// Lease.Stop returns; Lost itself may run after that.
	Renewed  func(n int)
	Retrying func(n int, err error)
	Lost     func(d *adapters.Delivery, cause error)
}

// Keeper renews leases. Create it with New, start it with Run, and end it by
// cancelling Run's context.
type Keeper struct {
	ext      adapters.Extender
	cfg      Config
	epoch    time.Time // tick 0
	lease    int64     // cfg.Lease, in ticks
	interval int64
	slack    int64
	// yield is startOne as a func value, made once: StartAll passes it to
	// the caller's iterator without allocating a closure per call.
	yield func(*Lease, *adapters.Delivery) bool

	mu       sync.Mutex
	t        table
	inFlight int // leases taken for renewal, out of the heap until it returns
	// armed is the earliest due time the scheduler will wake for without
	// being poked: a lease scheduled later needs no wake-up.
	armed  int64
	wake   chan struct{}
	closed bool
	// StartAll's state while it runs, for startOne.
	starting bool
	startNow int64 // 0 until read
	// needPoke is set when a lease was scheduled before armed, within one
	// hold of the lock, which pokes the scheduler once it let go.
	needPoke bool
}

// Lease is one tracked delivery. It names the keeper's state for the
// delivery; the keeper reads it in Stop and never after Stop returned.
type Lease struct {
	k    *Keeper
	gen  uint64
	slot int32 // -1: started on a keeper that had stopped
}

// New returns a Keeper renewing through ext. It fails when cfg is invalid.
func New(ext adapters.Extender, cfg Config) (*Keeper, error) {
	if ext == nil {
		return nil, errors.New("lease: nil Extender")
	}
	if cfg.Lease <= 0 {
		return nil, fmt.Errorf("lease: Config.Lease must be positive, got %v", cfg.Lease)
	}
	if cfg.Fraction == 0 {
		cfg.Fraction = 1.0 / 3
	}
	if !(cfg.Fraction > 0 && cfg.Fraction < 1) { // NaN too
		return nil, fmt.Errorf("lease: Config.Fraction must be in (0, 1), got %v", cfg.Fraction)
	}
	if cfg.MaxBatch <= 0 {
		cfg.MaxBatch = 10
	}
	if cfg.Parallel <= 0 {
		cfg.Parallel = 4
	}
	interval := time.Duration(float64(cfg.Lease) * cfg.Fraction)
	if interval <= 0 {
		interval = time.Millisecond
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = interval
	}
	k := &Keeper{
		ext:      ext,
		cfg:      cfg,
		epoch:    time.Now(),
		lease:    int64(cfg.Lease),
		interval: int64(interval),
		// Renewing a little early costs nothing and fills batches: take
		// leases due within a quarter of the interval along with those due now.
		slack: int64(interval / 4),
		armed: never,
		wake:  make(chan struct{}, 1),
	}
	k.t.minStale = minStale
	k.yield = k.startOne
	return k, nil
}

// maxTick bounds the ticks of a time, far enough from the int64 range that
// differences and sums of lease lengths cannot overflow.
const maxTick = 1 << 62

// ticks converts t to ticks, by its monotonic reading where it has one.
func (k *Keeper) ticks(t time.Time) int64 {
	return min(max(int64(t.Sub(k.epoch)), -maxTick), maxTick)
}

func (k *Keeper) now() int64 { return k.ticks(time.Now()) }

// Track starts keeping d's lease alive, counting it and MaxHold from
// d.ReceivedAt (or now when that is zero). The keeper loses a delivery
// through its Signal, which it gives d if d has none.
func (k *Keeper) Track(d *adapters.Delivery) *Lease {
	l := new(Lease)
	k.Start(l, d)
	return l
}

// Start is Track with a Lease the caller provides, typically embedded in its
// own per-delivery state to save an allocation per delivery. l must be a zero
// Lease, or one that was stopped.
func (k *Keeper) Start(l *Lease, d *adapters.Delivery) {
	k.StartAll(func(yield func(*Lease, *adapters.Delivery) bool) { yield(l, d) })
}

// StartAll is Start for every pair leases yields, under one lock: a receiver
// tracks a whole batch at the cost of one.
func (k *Keeper) StartAll(leases iter.Seq2[*Lease, *adapters.Delivery]) {
	k.mu.Lock()
	k.starting, k.startNow = true, 0
	leases(k.yield)
	k.starting = false
	poke := k.needPoke
	k.needPoke = false
	k.mu.Unlock()
	if poke {
		k.poke()
	}
}

// startOne starts one lease for StartAll, under the lock.
func (k *Keeper) startOne(l *Lease, d *adapters.Delivery) bool {
	if !k.starting {
		panic("lease: StartAll's iterator called yield after it returned")
	}
	if d.Signal == nil {
		d.Signal = new(adapters.Signal) // the keeper loses deliveries through it
	}
	var start int64
	if d.ReceivedAt.IsZero() {
		if k.startNow == 0 {
			k.startNow = k.now()
		}
		start = k.startNow
	} else {
		start = k.ticks(d.ReceivedAt)
	}
	due := addTicks(start, k.interval)
	deadline := int64(never)
	if k.cfg.MaxHold > 0 {
		deadline = addTicks(start, int64(k.cfg.MaxHold))
		due = min(due, deadline)
	}
	if k.closed {
		*l = Lease{k: k, slot: -1}
		return true
	}
	i := k.t.alloc()
	s := &k.t.slots[i]
	s.d, s.expires, s.deadline = d, addTicks(start, k.lease), deadline
	*l = Lease{k: k, gen: s.gen, slot: i}
	k.schedule(i, due)
	return true
}

// schedule queues slot i at due, and notes whether the scheduler needs a
// wake-up for it.
func (k *Keeper) schedule(i int32, due int64) {
	k.t.push(i, due)
	if due < k.armed {
		k.armed = due
		k.needPoke = true
	}
}

// Stop ends renewals of the lease: once it returns, no extension of it is in
// flight or will be sent, and the keeper will not lose the delivery (see the
// package documentation, section Semantics). Stop must not be called from
// the delivery's OnLost callback, which runs inside a loss Stop would wait
// for. Stopping a lease again, or a zero Lease, does nothing.
func (l *Lease) Stop() {
	k := l.k
	if k == nil || l.slot < 0 {
		return
	}
	k.mu.Lock()
	s := &k.t.slots[l.slot]
	if s.gen != l.gen { // stopped already, or the keeper let it go
		k.mu.Unlock()
		return
	}
	wait := s.renewing
	if wait == nil {
		k.t.release(l.slot)
	} else {
		// Whoever holds the lease frees the slot once done with it.
		s.stopped = true
	}
	k.mu.Unlock()
	if wait != nil {
		<-wait
	}
}

// Len returns the number of leases being kept, those whose renewal is on
// the wire included.
func (k *Keeper) Len() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.t.queuedLen() + k.inFlight
}

func (k *Keeper) poke() {
	select {
	case k.wake <- struct{}{}:
	default:
	}
}

// Run schedules renewals until ctx is done, then waits for renewals on the
// wire to return and stops tracking everything.
func (k *Keeper) Run(ctx context.Context) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, k.cfg.Parallel)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		now := k.now()
		batches, next := k.takeDue(now)
		for _, b := range batches {
			if ctx.Err() != nil {
				// Stopping: a select with a free slot would pick either case.
				k.abandon(b)
				continue
			}
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				k.abandon(b)
				continue
			}
			wg.Add(1)
			go func(b batch) {
				defer func() { <-sem; wg.Done() }()
				k.renew(ctx, b)
			}(b)
		}
		if len(batches) > 0 {
			continue // more may be due already
		}
		wait := time.Hour
		if next != never {
			wait = time.Duration(next - now)
		}
		timer.Reset(wait)
		select {
		case <-ctx.Done():
			k.mu.Lock()
			k.closed = true
			k.t.clear()
			k.mu.Unlock()
			wg.Wait()
			return
		case <-k.wake:
		case <-timer.C:
		}
	}
}

type batch struct {
	extendTo time.Duration
	slots    []int32
}

// takeDue removes the leases due by now (plus slack) from the heap, marks
// them renewing and groups them into batches. It also loses the leases that
// reached their hold cap. It returns the tick the next lease falls due at,
// or never.
func (k *Keeper) takeDue(now int64) ([]batch, int64) {
	var (
		batches []batch
		expired []loss
	)
	horizon := addTicks(now, k.slack)
	k.mu.Lock()
	for {
		e, ok := k.t.peek()
		if !ok {
			break
		}
		s := &k.t.slots[e.slot]
		// Leases due soon are taken early, to fill batches; but not a
		// retry, nor a lease whose due time is its cap (its lease already
		// runs to the cap): taken early, either would fall due within the
		// slack again and be taken at once, call after call.
		limit := horizon
		if s.retry || (s.deadline != never && e.due >= s.deadline) {
			limit = now
		}
		if e.due > limit {
			break
		}
		k.t.pop()
		s.retry = false
		extendTo := k.lease
		if s.deadline != never {
			left := s.deadline - now
			if left <= 0 {
				s.stopped = true
				s.renewing = make(chan struct{}) // Stop waits for the loss
				expired = append(expired, loss{slot: e.slot, d: s.d, cause: ErrMaxHold})
				continue
			}
			extendTo = min(extendTo, left)
		}
		s.renewing = make(chan struct{})
		k.inFlight++
		// Batches are few and short: a linear scan beats a map here.
		i := slices.IndexFunc(batches, func(b batch) bool {
			return b.extendTo == time.Duration(extendTo) && len(b.slots) < k.cfg.MaxBatch
		})
		if i < 0 {
			i = len(batches)
			batches = append(batches, batch{extendTo: time.Duration(extendTo)})
		}
		batches[i].slots = append(batches[i].slots, e.slot)
	}
	next := int64(never)
	if e, ok := k.t.peek(); ok {
		next = e.due
	}
	k.armed = next
	k.mu.Unlock()
	k.lose(expired)
	return batches, next
}

func (k *Keeper) renew(ctx context.Context, b batch) {
	// A lease stopped while its batch waited for a free slot is not sent:
	// its handler finished, and the runtime is about to ack it.
	ds := make([]*adapters.Delivery, 0, len(b.slots))
	expires := int64(never) // the earliest lease of the batch runs out then
	k.mu.Lock()
	k.inFlight -= len(b.slots)
	kept := b.slots[:0]
	for _, i := range b.slots {
		s := &k.t.slots[i]
		if s.stopped || k.closed || ctx.Err() != nil {
			close(s.renewing)
			k.t.release(i)
			continue
		}
		kept = append(kept, i)
		ds = append(ds, s.d)
		expires = min(expires, s.expires)
	}
	b.slots = kept
	k.inFlight += len(kept)
	k.mu.Unlock()
	if len(ds) == 0 {
		return
	}
	sent := k.now()
	// The call ends by the time a failure would lose the lease (with only
	// the slack left), even before Timeout: see Semantics. A retried
	// renewal, or one that waited for a free slot, is sent with little of
	// its lease left.
	deadline := min(addTicks(sent, int64(k.cfg.Timeout)), expires-k.slack)
	cctx, cancel := context.WithDeadline(ctx, k.epoch.Add(time.Duration(deadline)))
	err := k.ext.Extend(cctx, ds, b.extendTo)
	cancel()
	now := k.now()
	extendTo := int64(b.extendTo)
	var (
		lost     []loss
		retrying int
		retryErr error
	)
	renewed := 0
	// A renewal cut short because Run's context ended is no failure: the
	// keeper is stopping, and stops tracking every lease.
	closing := ctx.Err() != nil
	k.mu.Lock()
	closing = closing || k.closed
	k.inFlight -= len(b.slots)
	for n, i := range b.slots {
		s := &k.t.slots[i]
		if e := adapters.EntryError(err, n); e != nil {
			if s.stopped || closing {
				close(s.renewing)
				k.t.release(i)
				continue
			}
			// Not a refusal (a network error, throttling, a timeout): the
			// lease stands as last granted; try again while it has time.
			left := s.expires - now
			if !errors.Is(e, adapters.ErrLeaseLost) && left > k.slack {
				close(s.renewing)
				s.renewing = nil
				s.retry = true
				k.schedule(i, now+min(k.interval/2, left/2))
				retrying++
				retryErr = e
				continue
			}
			// s.renewing stays open until the delivery is lost, so that a
			// Stop now waits for the loss.
			s.stopped = true
			cause := e
			if !errors.Is(cause, adapters.ErrLeaseLost) {
				cause = fmt.Errorf("%w: renewals failed until the lease ran out: %w", adapters.ErrLeaseLost, cause)
			}
			lost = append(lost, loss{slot: i, d: s.d, cause: cause})
			continue
		}
		close(s.renewing)
		s.renewing = nil
		renewed++
		s.expires = addTicks(sent, extendTo)
		if s.stopped || closing {
			k.t.release(i)
			continue
		}
		due := addTicks(now, int64(float64(extendTo)*k.cfg.Fraction))
		if extendTo < k.lease || s.deadline < due {
			// The last extension before the cap: come back at the cap to
			// lose the delivery rather than renew it.
			due = min(addTicks(now, extendTo), s.deadline)
		}
		k.schedule(i, due)
	}
	poke := k.needPoke
	k.needPoke = false
	k.mu.Unlock()
	// Losses first: until they are made, a Stop of those leases waits, so
	// no callback runs before that.
	k.lose(lost)
	if renewed > 0 && k.cfg.Renewed != nil {
		k.cfg.Renewed(renewed)
	}
	if retrying > 0 && k.cfg.Retrying != nil {
		k.cfg.Retrying(retrying, retryErr)
	}
	if poke {
		k.poke()
	}
}

// abandon releases leases taken for a renewal that will not be sent because
// the keeper is stopping.
func (k *Keeper) abandon(b batch) {
	k.mu.Lock()
	k.inFlight -= len(b.slots)
	for _, i := range b.slots {
		close(k.t.slots[i].renewing)
		k.t.release(i)
	}
	k.mu.Unlock()
}

// loss is a delivery the keeper decided to lose, its lease stopped and its
// renewing channel open.
type loss struct {
	slot  int32
	d     *adapters.Delivery
	cause error
}

// lose loses the deliveries of ls, then closes their leases' renewing
// channels and frees their slots, so that a Stop racing the loss returns
// only once the delivery is lost; then it reports them to Config.Lost.
func (k *Keeper) lose(ls []loss) {
	if len(ls) == 0 {
		return
	}
	for _, x := range ls {
		x.d.Signal.Lose(x.cause)
	}
	k.mu.Lock()
	for _, x := range ls {
		close(k.t.slots[x.slot].renewing)
		k.t.release(x.slot)
	}
	k.mu.Unlock()
	if k.cfg.Lost != nil {
		for _, x := range ls {
			k.cfg.Lost(x.d, x.cause)
		}
	}
}
