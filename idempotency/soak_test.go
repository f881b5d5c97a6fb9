package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/teststores"
	"github.com/custody-go/custody/internal/testkit/soaktest"
)

// TestSoakNeverRunsOneKeyTwiceAtOnce runs the middleware, on every store,
// under consumers on the memory broker that overlap, stop and die, with
// messages published up to three times each, handlers that fail, panic and
// outlive their broker lease (some ignoring their context), and broker
// renewals that fail so that the broker hands a message to a second
// consumer while the first still works on it. It checks what the package
// promises:
//
//   - two live handlers of one key never run at once: a second starts only
//     once the first's claim was lost (its context cancelled with
//     ErrClaimLost, and reported);
//   - every key's effect happens, unless every copy of it was dead-lettered;
//   - with no consumer dying and no claim lost, every key's effect happens
//     once, however many copies were published or redelivered.
//
// A consumer dies as a process does: its source crashes, its store calls
// fail from then on (its claims are neither completed nor released, and
// run out), and its handlers take no further effect.
//
// Each round logs its seed. CUSTODY_IDEMPOTENCY_SOAK_SEED replays a round,
// CUSTODY_IDEMPOTENCY_SOAK_ROUNDS runs more (default 1 per store).
func TestSoakNeverRunsOneKeyTwiceAtOnce(t *testing.T) {
	for _, st := range teststores.All() {
		t.Run(st.Name, func(t *testing.T) {
			soaktest.Rounds(t, "CUSTODY_IDEMPOTENCY_SOAK", 1, func(t *testing.T, seed uint64) {
				idemSoakRound(t, seed, st.New(t))
			})
		})
	}
}

const (
	idemSoakKeys   = 30
	idemClaimLease = time.Second
)

type idemSoak struct {
	t          *testing.T
	store      idempotency.Store
	br         *memory.Broker
	lease      time.Duration
	extendFail float64
	checks     sync.WaitGroup
	log        *soaktest.Log // the violations, and each consumer's run

	mu         sync.Mutex
	rng        *rand.Rand
	running    map[string][]*idemCall // by key
	effects    map[string]int
	dead       map[int]bool // consumers that died
	claimsLost bool
}

type idemCall struct {
	gen int
	ctx context.Context
}

func idemSoakRound(t *testing.T, seed uint64, store idempotency.Store) {
	rng := rand.New(rand.NewPCG(seed, 1))
	s := &idemSoak{
		t: t, store: store, br: memory.NewBroker(),
		lease:   time.Duration(400+rng.IntN(300)) * time.Millisecond,
		rng:     rand.New(rand.NewPCG(seed, 2)),
		running: make(map[string][]*idemCall),
		effects: make(map[string]int),
		dead:    make(map[int]bool),
		log:     soaktest.NewLog(0), // its overlap checks are not used
	}
	if rng.IntN(3) == 0 {
		s.extendFail = 0.3
	}
	defer s.checks.Wait()
	for _, q := range []string{"q", "dlq"} {
		if err := s.br.CreateQueue(q, memory.QueueOptions{Lease: s.lease}); err != nil {
			t.Fatal(err)
		}
	}
	// Each key published one to three times, the copies spread out.
	prefix := fmt.Sprintf("soak-%d-", seed)
	copies := make(map[string]int)
	var msgs []memory.Message
	for k := range idemSoakKeys {
		key := prefix + strconv.Itoa(k)
		copies[key] = 1 + rng.IntN(3)
		for range copies[key] {
			msgs = append(msgs, memory.Message{Body: []byte(key), Headers: map[string]string{"key": key}})
		}
	}
	rng.Shuffle(len(msgs), func(i, j int) { msgs[i], msgs[j] = msgs[j], msgs[i] })
	if err := s.br.Publish(context.Background(), "q", msgs...); err != nil {
		t.Fatal(err)
	}
	phases := rng.IntN(3)
	t.Logf("lease %v, renewal failures %v, %d phases, %d messages", s.lease, s.extendFail, phases, len(msgs))

	gen := 0
	for range phases {
		var wg sync.WaitGroup
		for range 1 + rng.IntN(3) {
			gen++
			g, life, die := gen, time.Duration(200+rng.IntN(1000))*time.Millisecond, rng.IntN(2) == 0
			wg.Go(func() { s.consume(g, life, die) })
		}
		wg.Wait()
	}
	gen++
	s.consume(gen, 0, false)

	s.checks.Wait()
	for _, v := range s.log.Violations() {
		t.Error(v)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	dead, err := s.br.Messages("dlq")
	if err != nil {
		t.Fatal(err)
	}
	deadLettered := make(map[string]int)
	for _, m := range dead {
		deadLettered[string(m.Body)]++
	}
	died := len(s.dead) > 0
	for key, n := range copies {
		switch e := s.effects[key]; {
		case e == 0 && deadLettered[key] < n:
			t.Errorf("key %s: no effect, and %d of its %d copies dead-lettered: lost", key, deadLettered[key], n)
		case e > 1 && !died && !s.claimsLost:
			t.Errorf("key %s: effect ran %d times with no consumer dying and no claim lost", key, e)
		}
	}
	t.Logf("%d consumers (%d died), claims lost: %v, %d dead-lettered", gen, len(s.dead), s.claimsLost, len(dead))
}

func (s *idemSoak) violate(format string, args ...any) { s.log.Violate(format, args...) }

func (s *idemSoak) isDead(gen int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dead[gen]
}

// consume runs consumer gen for life (until the queue is empty, when 0),
// then stops it, or kills it if die.
func (s *idemSoak) consume(gen int, life time.Duration, die bool) {
	src, err := s.br.Source("q", memory.WithPollWait(20*time.Millisecond), memory.WithFaults(memory.Faults{
		Extend: func(*adapters.Delivery) error {
			s.mu.Lock()
			fail := s.rng.Float64() < s.extendFail
			s.mu.Unlock()
			if fail {
				return errors.New("soak: injected renewal failure")
			}
			return nil
		},
	}))
	if err != nil {
		s.t.Fatal(err)
	}
	dlq, err := s.br.DeadLetterQueue("dlq")
	if err != nil {
		s.t.Fatal(err)
	}
	mw, err := idempotency.New(&dyingStore{Store: s.store, dead: func() bool { return s.isDead(gen) }},
		idempotency.WithKeyFunc(func(m *consumer.Message) string { return m.Headers["key"] }),
		idempotency.WithLease(idemClaimLease),
		idempotency.WithOverlapRetryDelay(20*time.Millisecond),
		idempotency.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		s.t.Fatal(err)
	}
	c, err := consumer.New(src, consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return s.effect(ctx, gen, m)
	}), mw),
		consumer.WithConcurrency(4),
		consumer.WithDeadLetter(dlq),
		// Overlapping duplicates are deferred, and each deferral raises the
		// memory broker's delivery count: enough attempts that a copy
		// waiting for a slow one is not dead-lettered for it.
		consumer.WithRetry(consumer.Retry{MaxAttempts: 50, Backoff: consumer.ConstantBackoff(5 * time.Millisecond)}),
		consumer.WithShutdownTimeout(s.lease),
		consumer.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		s.t.Fatal(err)
	}
	s.log.Drive(gen, c, func(cancel context.CancelFunc) {
		if life == 0 {
			s.log.AwaitEmpty(s.br, "q", 2*time.Minute)
			cancel()
			return
		}
		time.Sleep(life)
		if die {
			s.mu.Lock()
			s.dead[gen] = true
			s.mu.Unlock()
			src.Crash()
		}
		cancel()
	}, func(error) bool { return die })
}

// effect is the handler behind the middleware.
func (s *idemSoak) effect(ctx context.Context, gen int, m *consumer.Message) error {
	key := m.Headers["key"]
	call := &idemCall{gen: gen, ctx: ctx}
	s.mu.Lock()
	var live []*idemCall
	for _, c := range s.running[key] {
		if !s.dead[c.gen] {
			live = append(live, c)
		}
	}
	s.running[key] = append(s.running[key], call)
	r := s.rng.Float64()
	slow := time.Duration(float64(s.lease) * (0.5 + s.rng.Float64()))
	s.mu.Unlock()
	for _, o := range live {
		// Another live handler of the key runs: only a lost claim lets
		// that happen, and it cancels the older one's context, before the
		// claim runs out (the margin absorbs a loaded machine).
		s.checks.Go(func() {
			select {
			case <-o.ctx.Done():
				if errors.Is(context.Cause(o.ctx), idempotency.ErrClaimLost) {
					s.mu.Lock()
					s.claimsLost = true
					s.mu.Unlock()
					return
				}
				s.violate("key %s ran in consumer %d while consumer %d ran it, whose context ended with %v, not a lost claim",
					key, gen, o.gen, context.Cause(o.ctx))
			case <-time.After(2 * time.Second):
				s.violate("key %s ran in consumer %d while consumer %d still ran it, its claim held", key, gen, o.gen)
			}
		})
	}
	defer func() {
		s.mu.Lock()
		calls := s.running[key]
		for i, c := range calls {
			if c == call {
				s.running[key] = append(calls[:i:i], calls[i+1:]...)
				break
			}
		}
		s.mu.Unlock()
	}()

	switch {
	case r < 0.1:
		return errors.New("soak: failed")
	case r < 0.13:
		panic("soak: panicked")
	case r < 0.2: // outlives its lease, ignoring its context
		time.Sleep(slow)
	case r < 0.25:
		t := time.NewTimer(slow)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dead[gen] {
		return errors.New("soak: the process is gone")
	}
	s.effects[key]++
	return nil
}

// dyingStore is a consumer's view of the shared store: once the consumer
// dies, its calls fail, as a dead process makes none.
type dyingStore struct {
	idempotency.Store
	dead func() bool
}

var errGone = errors.New("soak: the process is gone")

func (d *dyingStore) Claim(ctx context.Context, key, fp string, lease time.Duration) (idempotency.State, idempotency.Token, error) {
	if d.dead() {
		return 0, "", errGone
	}
	return d.Store.Claim(ctx, key, fp, lease)
}

func (d *dyingStore) Extend(ctx context.Context, key string, tok idempotency.Token, lease time.Duration) error {
	if d.dead() {
		return errGone
	}
	return d.Store.Extend(ctx, key, tok, lease)
}

func (d *dyingStore) Complete(ctx context.Context, key string, tok idempotency.Token, retention time.Duration) error {
	if d.dead() {
		return errGone
	}
	return d.Store.Complete(ctx, key, tok, retention)
}

func (d *dyingStore) Release(ctx context.Context, key string, tok idempotency.Token) error {
	if d.dead() {
		return errGone
	}
	return d.Store.Release(ctx, key, tok)
}
