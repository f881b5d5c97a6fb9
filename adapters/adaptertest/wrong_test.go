package adaptertest

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
)

// These tests show that the checks of policy.go catch what they are for:
// each runs against the memory broker behind a wrapper that does one thing
// the contract forbids (fetch ahead, renew, linger, retry, share a Signal,
// return more than asked), and must fail; behind an honest wrapper, the
// same checks pass. A check that fails calls t.Fatal, so each wrong adapter
// runs in a child process of the test binary, whose failure and output the
// parent inspects.

type wrongAdapter struct {
	name  string
	check string // the name of the check that must fail it
	wrap  func(*memory.Source) adapters.Source
	want  string
}

// wrongAdapters are the deliberately wrong adapters, each with the check
// that must catch it and words its failure must contain.
var wrongAdapters = []wrongAdapter{
	{"FetchesAhead", "NoFetchAhead", func(s *memory.Source) adapters.Source { return &fetchingAhead{base: base{s}} }, "fetched ahead"},
	{"RenewsByItself", "NoSelfRenewal", newSelfRenewing, "renewed its lease by itself"},
	{"LingersOnAck", "AckDoesNotLinger", newLingering, "acked messages were delivered again"},
	{"LingersOnNack", "NackDoesNotLinger", newLingering, "the Nack had not reached the broker"},
	{"LingersOnExtend", "ExtendDoesNotLinger", newLingering, "the Extend had not reached the broker"},
	{"RetriesEntries", "RefusedEntryIsNotRetried", func(s *memory.Source) adapters.Source { return &retrying{base{s}} }, "tried the entry again by itself"},
	{"ReceivesPastMax", "MaxReceive", func(s *memory.Source) adapters.Source { return &overReceiving{base{s}} }, "returned 5 deliveries"},
	{"PoolsConcurrentReceives", "ConcurrentReceives", func(s *memory.Source) adapters.Source { return &pooling{base: base{s}} }, "among 4 concurrent calls returned"},
	{"SharesSignals", "SignalPerDelivery", func(s *memory.Source) adapters.Source { return &sharingSignals{base{s}} }, "shares its Signal"},
}

// wrongEnv names the wrong adapter a child process runs.
const wrongEnv = "ADAPTERTEST_WRONG_ADAPTER"

func TestWrongAdaptersFail(t *testing.T) {
	if os.Getenv(wrongEnv) != "" {
		t.Skip("in a child process")
	}
	for _, w := range wrongAdapters {
		t.Run(w.name, func(t *testing.T) {
			t.Parallel()
			cmd := exec.Command(os.Args[0], "-test.run=^TestWrongAdapter$", "-test.v", "-test.count=1")
			cmd.Env = append(os.Environ(), wrongEnv+"="+w.name)
			out, err := cmd.CombinedOutput()
			var exit *exec.ExitError
			if !errors.As(err, &exit) {
				t.Fatalf("the check passed an adapter that %s (err %v):\n%s", w.name, err, out)
			}
			if !strings.Contains(string(out), w.want) {
				t.Fatalf("the check failed an adapter that %s, but not saying %q:\n%s", w.name, w.want, out)
			}
			t.Logf("caught:\n%s", failureLines(out))
		})
	}
}

// TestWrongAdapter runs one wrong adapter's check, in a child process of
// TestWrongAdaptersFail.
func TestWrongAdapter(t *testing.T) {
	name := os.Getenv(wrongEnv)
	if name == "" {
		t.Skip("run by TestWrongAdaptersFail, in a child process")
	}
	i := slices.IndexFunc(wrongAdapters, func(w wrongAdapter) bool { return w.name == name })
	if i < 0 {
		t.Fatalf("no wrong adapter %q", name)
	}
	w := wrongAdapters[i]
	checkNamed(w.check)(t, memoryHarness(w.wrap))
}

// TestHonestAdapterPasses runs the checks that the wrong adapters fail
// against the memory broker behind a wrapper that only declares what the
// wrong ones do (several receivers, a bounded Receive), so that their
// failures come from what they do wrong.
func TestHonestAdapterPasses(t *testing.T) {
	h := memoryHarness(func(s *memory.Source) adapters.Source { return &honest{base{s}} })
	seen := map[string]bool{}
	for _, w := range wrongAdapters {
		if seen[w.check] {
			continue
		}
		seen[w.check] = true
		t.Run(w.check, func(t *testing.T) {
			t.Parallel()
			checkNamed(w.check)(t, h)
		})
	}
}

func failureLines(out []byte) string {
	var keep []string
	for _, l := range strings.Split(string(out), "\n") {
		if strings.Contains(l, "policy.go") || strings.Contains(l, "source.go") {
			keep = append(keep, strings.TrimSpace(l))
		}
	}
	return strings.Join(keep, "\n")
}

// memoryHarness is a harness over the memory broker whose Sources are
// wrapped by wrap, with leases of half what the suite asks (as the memory
// adapter's own harness), and a short wait for what never comes.
func memoryHarness(wrap func(*memory.Source) adapters.Source) Harness {
	return Harness{
		wait: 3 * time.Second,
		NewQueue: func(t *testing.T, cfg QueueConfig) *Queue {
			b := memory.NewBroker()
			lease := cfg.Lease / 2
			if err := b.CreateQueue("q", memory.QueueOptions{Lease: lease, FIFO: cfg.Ordered}); err != nil {
				t.Fatal(err)
			}
			return &Queue{
				Lease: lease,
				Publish: func(ctx context.Context, msgs ...Message) error {
					for _, m := range msgs {
						if err := b.Publish(ctx, "q", memory.Message{Body: m.Body, Headers: m.Headers, Key: m.Key}); err != nil {
							return err
						}
					}
					return nil
				},
				Open: func(t *testing.T) adapters.Source {
					src, err := b.Source("q", memory.WithPollWait(20*time.Millisecond))
					if err != nil {
						t.Fatal(err)
					}
					return wrap(src)
				},
				Crash: func(src adapters.Source) { src.(wrapper).inner().Crash() },
				Refuse: func(src adapters.Source) {
					var refused atomic.Bool
					src.(wrapper).inner().SetFaults(memory.Faults{Ack: func(*adapters.Delivery) error {
						if refused.CompareAndSwap(false, true) {
							return errors.New("refused by the test, as a broker under strain would")
						}
						return nil
					}})
				},
			}
		},
	}
}

type wrapper interface{ inner() *memory.Source }

// base passes everything on to the memory Source it wraps.
type base struct{ *memory.Source }

func (b base) inner() *memory.Source { return b.Source }

// honest declares several receivers and a bounded Receive, and does what
// the memory Source does.
type honest struct{ base }

func (h *honest) Capabilities() adapters.Capabilities {
	c := h.Source.Capabilities()
	c.Receivers, c.MaxReceive = 4, 4
	return c
}

// fetchingAhead fetches ten more than Receive asks for and hands them out
// from a buffer on later calls.
type fetchingAhead struct {
	base
	mu  sync.Mutex
	buf []*adapters.Delivery
}

func (f *fetchingAhead) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.buf) == 0 {
		ds, err := f.Source.Receive(ctx, max+10)
		if err != nil {
			return nil, err
		}
		f.buf = ds
	}
	n := min(max, len(f.buf))
	out := f.buf[:n:n]
	f.buf = f.buf[n:]
	return out, nil
}

// selfRenewing renews the lease of every delivery it handed out, at a third
// of the lease, until it is acked or nacked.
type selfRenewing struct {
	base
	mu   sync.Mutex
	held map[*adapters.Delivery]bool
	stop chan struct{}
	done chan struct{}
}

func newSelfRenewing(s *memory.Source) adapters.Source {
	r := &selfRenewing{base: base{s}, held: map[*adapters.Delivery]bool{}, stop: make(chan struct{}), done: make(chan struct{})}
	go r.renew()
	return r
}

func (r *selfRenewing) renew() {
	defer close(r.done)
	lease := r.Source.Capabilities().Lease
	tick := time.NewTicker(lease / 3)
	defer tick.Stop()
	for {
		select {
		case <-r.stop:
			return
		case <-tick.C:
		}
		r.mu.Lock()
		var ds []*adapters.Delivery
		for d := range r.held {
			ds = append(ds, d)
		}
		r.mu.Unlock()
		_ = r.Source.Extend(context.Background(), ds, lease)
	}
}

func (r *selfRenewing) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	ds, err := r.Source.Receive(ctx, max)
	r.mu.Lock()
	for _, d := range ds {
		r.held[d] = true
	}
	r.mu.Unlock()
	return ds, err
}

func (r *selfRenewing) forget(ds []*adapters.Delivery) {
	r.mu.Lock()
	for _, d := range ds {
		delete(r.held, d)
	}
	r.mu.Unlock()
}

func (r *selfRenewing) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	r.forget(ds)
	return r.Source.Ack(ctx, ds)
}

func (r *selfRenewing) Nack(ctx context.Context, ns []adapters.Nack) error {
	for _, n := range ns {
		r.forget([]*adapters.Delivery{n.Delivery})
	}
	return r.Source.Nack(ctx, ns)
}

func (r *selfRenewing) Close() error {
	close(r.stop)
	<-r.done
	return r.Source.Close()
}

// lingering answers Ack, Nack and Extend at once and sends them a second
// later, in one go, or when it is closed.
type lingering struct {
	base
	mu      sync.Mutex
	pending []func()
	timer   *time.Timer
}

func newLingering(s *memory.Source) adapters.Source { return &lingering{base: base{s}} }

func (l *lingering) later(op func()) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.pending = append(l.pending, op)
	if l.timer == nil {
		l.timer = time.AfterFunc(time.Second, l.flush)
	}
}

func (l *lingering) flush() {
	l.mu.Lock()
	ops := l.pending
	l.pending, l.timer = nil, nil
	l.mu.Unlock()
	for _, op := range ops {
		op()
	}
}

func (l *lingering) Ack(_ context.Context, ds []*adapters.Delivery) error {
	ds = slices.Clone(ds)
	l.later(func() { _ = l.Source.Ack(context.Background(), ds) })
	return nil
}

func (l *lingering) Nack(_ context.Context, ns []adapters.Nack) error {
	ns = slices.Clone(ns)
	l.later(func() { _ = l.Source.Nack(context.Background(), ns) })
	return nil
}

func (l *lingering) Extend(_ context.Context, ds []*adapters.Delivery, d time.Duration) error {
	ds = slices.Clone(ds)
	l.later(func() { _ = l.Source.Extend(context.Background(), ds, d) })
	return nil
}

func (l *lingering) Close() error {
	l.mu.Lock()
	if l.timer != nil {
		l.timer.Stop()
	}
	l.mu.Unlock()
	l.flush()
	return l.Source.Close()
}

// retrying tries again, a few times, the Ack entries the broker refused.
type retrying struct{ base }

func (r *retrying) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	err := r.Source.Ack(ctx, ds)
	for try := 0; try < 3; try++ {
		var be *adapters.BatchError
		if !errors.As(err, &be) {
			return err
		}
		time.Sleep(20 * time.Millisecond)
		failed := map[int]error{}
		for i, e := range be.Failed {
			if e2 := r.Source.Ack(ctx, ds[i:i+1]); e2 != nil {
				failed[i] = e
			}
		}
		if len(failed) == 0 {
			return nil
		}
		err = &adapters.BatchError{Failed: failed}
	}
	return err
}

// overReceiving declares MaxReceive 4 and returns up to 5.
type overReceiving struct{ base }

func (o *overReceiving) Capabilities() adapters.Capabilities {
	c := o.Source.Capabilities()
	c.MaxReceive = 4
	return c
}

func (o *overReceiving) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	return o.Source.Receive(ctx, max+1)
}

// pooling declares four receivers, and makes Receive calls that come within
// 200 ms of the first share one fetch, for all of them, whose deliveries the
// first caller returns.
type pooling struct {
	base
	mu     sync.Mutex
	asked  int
	pooled chan struct{} // closed when the shared fetch is made; nil when none gathers
}

func (p *pooling) Capabilities() adapters.Capabilities {
	c := p.Source.Capabilities()
	c.Receivers = 4
	return c
}

func (p *pooling) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	p.mu.Lock()
	if pooled := p.pooled; pooled != nil {
		p.asked += max
		p.mu.Unlock()
		<-pooled // the first caller returns what this call asked for
		return nil, ctx.Err()
	}
	p.asked = max
	pooled := make(chan struct{})
	p.pooled = pooled
	p.mu.Unlock()
	select {
	case <-time.After(200 * time.Millisecond):
	case <-ctx.Done():
	}
	p.mu.Lock()
	asked := p.asked
	p.pooled = nil
	p.mu.Unlock()
	defer close(pooled)
	return p.Source.Receive(ctx, asked)
}

// sharingSignals gives all the deliveries of one Receive call one Signal.
type sharingSignals struct{ base }

func (s *sharingSignals) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	ds, err := s.Source.Receive(ctx, max)
	sig := new(adapters.Signal)
	for _, d := range ds {
		d.Signal = sig
	}
	return ds, err
}
