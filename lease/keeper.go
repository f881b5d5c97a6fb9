package lease

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"iter"
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
	// Timeout bounds one Extend call. Default: the renewal interval.
	Timeout time.Duration
	// Renewed, when set, is called after each successful renewal batch with
	// the number of leases renewed. Retrying is called when n renewals
	// failed with err but their leases have time left, so they are tried
	// again. Lost is called for each delivery the keeper loses (at MaxHold,
	// or after a renewal failed for good); not for one the adapter loses by
	// itself, nor for one whose lease was stopped before the keeper lost
	// it. The delivery is lost (Delivery.Lose has returned) before its
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
	interval time.Duration
	slack    time.Duration

	mu       sync.Mutex
	due      leaseHeap
	inFlight int // leases taken for renewal, out of the heap until it returns
	wake     chan struct{}
	closed   bool
}

// Lease is one tracked delivery.
type Lease struct {
	k        *Keeper
	d        *adapters.Delivery
	due      time.Time
	expires  time.Time // when the broker lets the lease run out, as last granted
	deadline time.Time // zero: no cap
	index    int       // position in the heap, -1 when not in it
	// renewing is open while the keeper works on the lease outside its
	// lock: a renewal taken or on the wire, or a loss being made. Stop
	// waits for it to close.
	renewing chan struct{}
	stopped  bool
	// retry is set when due is a retry of a failed renewal. A retry is
	// taken when due, not early with the leases due soon: its next retry
	// would fall within the slack again and be taken at once.
	retry bool
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
	return &Keeper{
		ext:      ext,
		cfg:      cfg,
		interval: interval,
		// Renewing a little early costs nothing and fills batches: take
		// leases due within a quarter of the interval along with those due now.
		slack: interval / 4,
		wake:  make(chan struct{}, 1),
	}, nil
}

// Track starts keeping d's lease alive, counting from d.ReceivedAt (or now
// when that is zero), or from d.LeasedAt when the adapter renewed the lease
// since; MaxHold counts from d.ReceivedAt.
func (k *Keeper) Track(d *adapters.Delivery) *Lease {
	l := new(Lease)
	k.Start(l, d)
	return l
}

// Start is Track with a Lease the caller provides, typically embedded in its
// own per-delivery state to save an allocation per delivery. l must be a zero
// Lease, or one that was stopped; it must not be copied while tracked.
func (k *Keeper) Start(l *Lease, d *adapters.Delivery) {
	k.StartAll(func(yield func(*Lease, *adapters.Delivery) bool) { yield(l, d) })
}

// StartAll is Start for every pair leases yields, under one lock: a receiver
// tracks a whole batch at the cost of one.
func (k *Keeper) StartAll(leases iter.Seq2[*Lease, *adapters.Delivery]) {
	var now time.Time
	first := false
	k.mu.Lock()
	for l, d := range leases {
		start := d.ReceivedAt
		if start.IsZero() {
			if now.IsZero() {
				now = time.Now()
			}
			start = now
		}
		// A lease the adapter renewed before handing the delivery over
		// (while it waited in a buffer) runs from that renewal: counted
		// from the receipt it would pass for expired, and one transient
		// failure of its first renewal would lose a delivery with most of
		// its lease left.
		leased := start
		if d.LeasedAt.After(leased) {
			leased = d.LeasedAt
		}
		*l = Lease{k: k, d: d, due: leased.Add(k.interval), expires: leased.Add(k.cfg.Lease), index: -1}
		if k.cfg.MaxHold > 0 {
			l.deadline = start.Add(k.cfg.MaxHold)
			if l.deadline.Before(l.due) {
				l.due = l.deadline
			}
		}
		if k.closed {
			continue
		}
		heap.Push(&k.due, l)
		first = first || l.index == 0
	}
	k.mu.Unlock()
	if first {
		k.poke()
	}
}

// Stop ends renewals of the lease. If a renewal of it is on the wire, Stop
// waits for that call to return, so after Stop no extension is in flight;
// a renewal taken but not yet sent is not sent. If the keeper is losing the
// delivery (at MaxHold, or after a failed renewal), Stop waits until it is
// lost: once Stop returns, the delivery's LostCause shows whether the keeper
// lost it, and the keeper will not lose it afterwards. Stop must not be
// called from the delivery's OnLost callback, which runs inside that loss.
func (l *Lease) Stop() {
	k := l.k
	k.mu.Lock()
	l.stopped = true
	wait := l.renewing
	if l.index >= 0 {
		heap.Remove(&k.due, l.index)
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
	return len(k.due) + k.inFlight
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
		now := time.Now()
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
		if !next.IsZero() {
			wait = next.Sub(now)
		}
		timer.Reset(wait)
		select {
		case <-ctx.Done():
			k.mu.Lock()
			k.closed = true
			for _, l := range k.due {
				l.index = -1
			}
			k.due = nil
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
	leases   []*Lease
}

// takeDue removes the leases due by now (plus slack) from the heap, marks
// them renewing and groups them into batches. It also loses the leases that
// reached their hold cap. It returns the time the next lease falls due.
func (k *Keeper) takeDue(now time.Time) ([]batch, time.Time) {
	var (
		batches []batch
		expired []loss
	)
	horizon := now.Add(k.slack)
	k.mu.Lock()
	for len(k.due) > 0 {
		l := k.due[0]
		// Leases due soon are taken early, to fill batches; but not a
		// retry, nor a lease whose due time is its cap (its lease already
		// runs to the cap): taken early, either would fall due within the
		// slack again and be taken at once, call after call.
		limit := horizon
		if l.retry || (!l.deadline.IsZero() && !l.due.Before(l.deadline)) {
			limit = now
		}
		if l.due.After(limit) {
			break
		}
		heap.Pop(&k.due)
		l.retry = false
		extendTo := k.cfg.Lease
		if !l.deadline.IsZero() {
			left := l.deadline.Sub(now)
			if left <= 0 {
				l.stopped = true
				l.renewing = make(chan struct{}) // Stop waits for the loss
				expired = append(expired, loss{l: l, d: l.d, cause: ErrMaxHold})
				continue
			}
			if left < extendTo {
				extendTo = left
			}
		}
		l.renewing = make(chan struct{})
		k.inFlight++
		// Batches are few and short: a linear scan beats a map here.
		placed := false
		for i := range batches {
			b := &batches[i]
			if b.extendTo == extendTo && len(b.leases) < k.cfg.MaxBatch {
				b.leases = append(b.leases, l)
				placed = true
				break
			}
		}
		if !placed {
			batches = append(batches, batch{extendTo: extendTo, leases: []*Lease{l}})
		}
	}
	var next time.Time
	if len(k.due) > 0 {
		next = k.due[0].due
	}
	k.mu.Unlock()
	k.lose(expired)
	return batches, next
}

func (k *Keeper) renew(ctx context.Context, b batch) {
	// A lease stopped while its batch waited for a free slot is not sent:
	// its handler finished, and the runtime is about to ack it.
	ds := make([]*adapters.Delivery, 0, len(b.leases))
	k.mu.Lock()
	k.inFlight -= len(b.leases)
	kept := b.leases[:0]
	for _, l := range b.leases {
		if l.stopped || k.closed || ctx.Err() != nil {
			close(l.renewing)
			l.renewing = nil
			continue
		}
		kept = append(kept, l)
		ds = append(ds, l.d)
	}
	b.leases = kept
	k.inFlight += len(kept)
	k.mu.Unlock()
	if len(ds) == 0 {
		return
	}
	sent := time.Now()
	cctx, cancel := context.WithTimeout(ctx, k.cfg.Timeout)
	err := k.ext.Extend(cctx, ds, b.extendTo)
	cancel()
	now := time.Now()
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
	k.inFlight -= len(b.leases)
	for i, l := range b.leases {
		if e := adapters.EntryError(err, i); e != nil {
			if l.stopped || closing {
				l.stopped = true
				close(l.renewing)
				l.renewing = nil
				continue
			}
			// A failure that does not say the lease is gone (a network
			// error, throttling, a timeout) leaves the lease as last
			// granted: try again while it has time left.
			left := l.expires.Sub(now)
			if !errors.Is(e, adapters.ErrLeaseLost) && left > k.slack {
				close(l.renewing)
				l.renewing = nil
				l.due = now.Add(min(k.interval/2, left/2))
				l.retry = true
				heap.Push(&k.due, l)
				retrying++
				retryErr = e
				continue
			}
			// l.renewing stays open until the delivery is lost, so that a
			// Stop now waits for the loss.
			l.stopped = true
			cause := e
			if !errors.Is(cause, adapters.ErrLeaseLost) {
				cause = fmt.Errorf("%w: renewals failed until the lease ran out: %w", adapters.ErrLeaseLost, cause)
			}
			lost = append(lost, loss{l: l, d: l.d, cause: cause})
			continue
		}
		close(l.renewing)
		l.renewing = nil
		renewed++
		l.expires = sent.Add(b.extendTo)
		if l.stopped || closing {
			continue
		}
		l.due = now.Add(time.Duration(float64(b.extendTo) * k.cfg.Fraction))
		if b.extendTo < k.cfg.Lease || (!l.deadline.IsZero() && l.deadline.Before(l.due)) {
			// The last extension before the cap: come back at the cap to
			// lose the delivery rather than renew it.
			l.due = now.Add(b.extendTo)
			if !l.deadline.IsZero() && l.deadline.Before(l.due) {
				l.due = l.deadline
			}
		}
		heap.Push(&k.due, l)
	}
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
	k.poke()
}

// abandon releases leases taken for a renewal that will not be sent because
// the keeper is stopping.
func (k *Keeper) abandon(b batch) {
	k.mu.Lock()
	k.inFlight -= len(b.leases)
	for _, l := range b.leases {
		close(l.renewing)
		l.renewing = nil
	}
	k.mu.Unlock()
}

// loss is a delivery the keeper decided to lose, its lease stopped and its
// renewing channel open.
type loss struct {
	l     *Lease
	d     *adapters.Delivery
	cause error
}

// lose loses the deliveries of ls, then closes their leases' renewing
// channels, so that a Stop racing the loss returns only once the delivery is
// lost; then it reports them to Config.Lost. Once a lease's channel is
// closed its owner may reuse it, so only the loss's own fields are read.
func (k *Keeper) lose(ls []loss) {
	if len(ls) == 0 {
		return
	}
	for _, x := range ls {
		x.d.Lose(x.cause)
	}
	k.mu.Lock()
	for _, x := range ls {
		close(x.l.renewing)
		x.l.renewing = nil
	}
	k.mu.Unlock()
	if k.cfg.Lost != nil {
		for _, x := range ls {
			k.cfg.Lost(x.d, x.cause)
		}
	}
}

// leaseHeap orders leases by due time.
type leaseHeap []*Lease

func (h leaseHeap) Len() int           { return len(h) }
func (h leaseHeap) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h leaseHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index = i
	h[j].index = j
}
func (h *leaseHeap) Push(x any) {
	l := x.(*Lease)
	l.index = len(*h)
	*h = append(*h, l)
}
func (h *leaseHeap) Pop() any {
	old := *h
	n := len(old)
	l := old[n-1]
	old[n-1] = nil
	l.index = -1
	*h = old[:n-1]
	return l
}
