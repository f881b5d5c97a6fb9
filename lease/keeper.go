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
	// itself, nor after the lease was stopped.
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

	mu     sync.Mutex
	due    leaseHeap
	wake   chan struct{}
	closed bool
}

// Lease is one tracked delivery.
type Lease struct {
	k        *Keeper
	d        *adapters.Delivery
	due      time.Time
	expires  time.Time // when the broker lets the lease run out, as last granted
	deadline time.Time // zero: no cap
	index    int       // position in the heap, -1 when not in it
	renewing chan struct{}
	stopped  bool
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
// when that is zero).
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
		*l = Lease{k: k, d: d, due: start.Add(k.interval), expires: start.Add(k.cfg.Lease), index: -1}
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
// waits for that call to return, so after Stop no extension is in flight.
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

// Len returns the number of leases being kept.
func (k *Keeper) Len() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.due)
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
		expired []*Lease
	)
	horizon := now.Add(k.slack)
	k.mu.Lock()
	for len(k.due) > 0 && !k.due[0].due.After(horizon) {
		l := heap.Pop(&k.due).(*Lease)
		extendTo := k.cfg.Lease
		if !l.deadline.IsZero() {
			left := l.deadline.Sub(now)
			if left <= 0 {
				l.stopped = true
				expired = append(expired, l)
				continue
			}
			if left < extendTo {
				extendTo = left
			}
		}
		l.renewing = make(chan struct{})
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
	for _, l := range expired {
		k.lose(l.d, ErrMaxHold)
	}
	return batches, next
}

func (k *Keeper) renew(ctx context.Context, b batch) {
	ds := make([]*adapters.Delivery, len(b.leases))
	for i, l := range b.leases {
		ds[i] = l.d
	}
	sent := time.Now()
	cctx, cancel := context.WithTimeout(ctx, k.cfg.Timeout)
	err := k.ext.Extend(cctx, ds, b.extendTo)
	cancel()
	now := time.Now()
	var (
		lost     []int
		retrying int
		retryErr error
	)
	renewed := 0
	k.mu.Lock()
	for i, l := range b.leases {
		close(l.renewing)
		l.renewing = nil
		if e := adapters.EntryError(err, i); e != nil {
			if l.stopped || k.closed {
				l.stopped = true
				continue
			}
			// A failure that does not say the lease is gone (a network
			// error, throttling, a timeout) leaves the lease as last
			// granted: try again while it has time left.
			left := l.expires.Sub(now)
			if !errors.Is(e, adapters.ErrLeaseLost) && left > k.slack {
				l.due = now.Add(min(k.interval/2, left/2))
				heap.Push(&k.due, l)
				retrying++
				retryErr = e
				continue
			}
			lost = append(lost, i)
			l.stopped = true
			continue
		}
		renewed++
		l.expires = sent.Add(b.extendTo)
		if l.stopped || k.closed {
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
	if renewed > 0 && k.cfg.Renewed != nil {
		k.cfg.Renewed(renewed)
	}
	if retrying > 0 && k.cfg.Retrying != nil {
		k.cfg.Retrying(retrying, retryErr)
	}
	for _, i := range lost {
		cause := adapters.EntryError(err, i)
		if !errors.Is(cause, adapters.ErrLeaseLost) {
			cause = fmt.Errorf("%w: renewals failed until the lease ran out: %w", adapters.ErrLeaseLost, cause)
		}
		k.lose(b.leases[i].d, cause)
	}
	k.poke()
}

// abandon releases leases taken for a renewal that will not be sent because
// the keeper is stopping.
func (k *Keeper) abandon(b batch) {
	k.mu.Lock()
	for _, l := range b.leases {
		close(l.renewing)
		l.renewing = nil
	}
	k.mu.Unlock()
}

func (k *Keeper) lose(d *adapters.Delivery, cause error) {
	d.Lose(cause)
	if k.cfg.Lost != nil {
		k.cfg.Lost(d, cause)
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
