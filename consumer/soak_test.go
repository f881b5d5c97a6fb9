package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testseed"
	"log/slog"
)

// TestSoakKeepsTheInvariants runs the runtime on the memory broker through
// rounds of random configurations, handler behaviours (failures, panics,
// permanent errors, deferrals, handlers outliving their lease), broker
// faults (failed acks, failed lease renewals) and consumers that stop, crash
// and overlap, and checks what a user relies on whatever happens:
//
//   - nothing is lost: every message ends handled or in the dead-letter
//     queue, with its diagnostics, and the queue ends empty;
//   - effect, then ack: no message is acked before a handler returned nil
//     for it or it was dead-lettered;
//   - no two handlers of one message run at once, and none of one FIFO
//     group or OrderByKey key within a consumer, unless the older one's
//     context was cancelled (its lease was lost);
//   - a FIFO group's messages are first settled (handled or dead-lettered)
//     in publish order;
//   - no handler runs once its consumer's Run has returned.
//
// Each round logs its seed. CUSTODY_SOAK_SEED replays a round;
// CUSTODY_SOAK_ROUNDS runs more of them (default 4).
func TestSoakKeepsTheInvariants(t *testing.T) {
	testseed.Rounds(t, 4, soakRound)
}

type soakConfig struct {
	fifo, byKey bool
	concurrency int
	inFlight    int
	lease       time.Duration
	maxAttempts int
	ackFail     float64 // the chance that an ack of a delivery fails
	extendFail  float64 // the chance that a renewal of a delivery fails
	phases      int     // consumer generations before the last, which runs to the end
}

const (
	soakMessages = 150
	soakKeys     = 8
)

func soakRound(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 1))
	chance := func(p float64) bool { return rng.Float64() < p }
	cfg := soakConfig{
		fifo:        chance(0.4),
		byKey:       chance(0.5),
		concurrency: 1 + rng.IntN(8),
		lease:       time.Duration(400+rng.IntN(400)) * time.Millisecond,
		maxAttempts: 2 + rng.IntN(3),
		phases:      rng.IntN(4),
	}
	if chance(0.5) {
		cfg.inFlight = cfg.concurrency + rng.IntN(40)
	}
	if chance(0.5) {
		cfg.ackFail = 0.05
	}
	if chance(0.3) {
		cfg.extendFail = 0.3
	}
	t.Logf("config %+v", cfg)

	br := memory.NewBroker()
	if err := br.CreateQueue("dlq", memory.QueueOptions{FIFO: cfg.fifo}); err != nil {
		t.Fatal(err)
	}
	if err := br.CreateQueue("q", memory.QueueOptions{Lease: cfg.lease, FIFO: cfg.fifo}); err != nil {
		t.Fatal(err)
	}
	msgs := make([]memory.Message, soakMessages)
	for i := range msgs {
		msgs[i] = memory.Message{Body: []byte(strconv.Itoa(i)), Key: fmt.Sprintf("k%d", i%soakKeys)}
	}
	if err := br.Publish(context.Background(), "q", msgs...); err != nil {
		t.Fatal(err)
	}
	dlq, err := br.DeadLetterQueue("dlq")
	if err != nil {
		t.Fatal(err)
	}
	s := &soak{
		t: t, cfg: cfg, br: br,
		rng:       rand.New(rand.NewPCG(seed, 2)),
		running:   make(map[string][]*soakCall),
		succeeded: make(map[string]bool),
		firsts:    make(map[string][]int),
		crashes:   make(map[int]bool),
		settled:   make(map[string]bool),
	}
	defer s.checks.Wait()

	// Earlier generations: one or two consumers at once, each stopped
	// after a while, gracefully or by a crash.
	gen := 0
	for range cfg.phases {
		var wg sync.WaitGroup
		for range 1 + rng.IntN(2) {
			gen++
			g, life, crash := gen, time.Duration(100+rng.IntN(1200))*time.Millisecond, chance(0.4)
			wg.Go(func() { s.consume(g, dlq, life, crash) })
		}
		wg.Wait()
	}
	// The last one runs until every message is settled.
	gen++
	s.consume(gen, dlq, 0, false)

	s.mu.Lock()
	defer s.mu.Unlock()
	for _, v := range s.violations {
		t.Error(v)
	}
	dead, err := br.Messages("dlq")
	if err != nil {
		t.Fatal(err)
	}
	deadLettered := make(map[string]bool)
	for _, m := range dead {
		id := m.Headers[adapters.HeaderOriginalID]
		if id == "" {
			id = m.ID
		}
		deadLettered[id] = true
		if m.Headers[adapters.HeaderError] == "" || m.Headers[adapters.HeaderAttempts] == "" {
			t.Errorf("dead-letter copy of %s (body %s) lacks its diagnostics: %v", id, m.Body, m.Headers)
		}
	}
	ids := s.ids()
	for i, id := range ids {
		if id == "" {
			t.Errorf("message %d was never handed to a handler", i)
			continue
		}
		if !s.succeeded[id] && !deadLettered[id] {
			t.Errorf("message %d (%s) was lost: never handled successfully, not dead-lettered", i, id)
		}
	}
	if cfg.fifo {
		for key, seqs := range s.firsts {
			if !slices.IsSorted(seqs) {
				t.Errorf("FIFO group %s first settled in the order %v, want publish order", key, seqs)
			}
		}
	}
	t.Logf("%d consumers; %d handled, %d dead-lettered", gen, len(s.succeeded), len(dead))
}

// soak is one round's shared state.
type soak struct {
	t      *testing.T
	cfg    soakConfig
	br     *memory.Broker
	checks sync.WaitGroup // overlap checks still waiting

	mu         sync.Mutex
	rng        *rand.Rand
	running    map[string][]*soakCall // by message ID
	succeeded  map[string]bool
	settled    map[string]bool  // handled successfully or dead-lettered
	firsts     map[string][]int // FIFO group → sequence numbers, in the order first settled
	seqToID    [soakMessages]string
	crashes    map[int]bool // consumers whose source crashed
	violations []string
}

// soakCall is one running handler call.
type soakCall struct {
	gen int
	ctx context.Context
	key string
}

func (s *soak) violate(format string, args ...any) {
	s.mu.Lock()
	s.violations = append(s.violations, fmt.Sprintf(format, args...))
	s.mu.Unlock()
}

func (s *soak) crashed(gen int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.crashes[gen]
}

func (s *soak) ids() []string {
	return s.seqToID[:]
}

func (s *soak) float() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rng.Float64()
}

// consume runs consumer generation gen for life (until every message is
// settled, when 0), then stops it, by a crash of its source if crash.
func (s *soak) consume(gen int, dlq adapters.DeadLetter, life time.Duration, crash bool) {
	var src *memory.Source
	faults := memory.Faults{
		Ack: func(d *adapters.Delivery) error {
			s.mu.Lock()
			ok := s.succeeded[d.ID]
			s.mu.Unlock()
			if !ok && !s.deadLettered(d.ID) {
				s.violate("message %s (body %s) acked before any handler succeeded or it was dead-lettered", d.ID, d.Body)
			}
			if s.float() < s.cfg.ackFail {
				return errors.New("soak: injected ack failure")
			}
			return nil
		},
		Extend: func(*adapters.Delivery) error {
			if s.float() < s.cfg.extendFail {
				return errors.New("soak: injected renewal failure")
			}
			return nil
		},
	}
	src, err := s.br.Source("q", memory.WithPollWait(20*time.Millisecond), memory.WithFaults(faults))
	if err != nil {
		s.t.Fatal(err)
	}
	opts := []consumer.Option{
		consumer.WithConcurrency(s.cfg.concurrency),
		consumer.WithDeadLetter(soakDeadLetter{dlq, s}),
		consumer.WithRetry(consumer.Retry{MaxAttempts: s.cfg.maxAttempts, Backoff: consumer.ConstantBackoff(2 * time.Millisecond)}),
		consumer.WithShutdownTimeout(s.cfg.lease),
		consumer.WithLogger(slog.New(slog.DiscardHandler)),
	}
	if s.cfg.inFlight > 0 {
		opts = append(opts, consumer.WithMaxInFlight(s.cfg.inFlight))
	}
	if s.cfg.byKey {
		opts = append(opts, consumer.WithOrdering(consumer.OrderByKey))
	}
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return s.handle(ctx, gen, m)
	}), opts...)
	if err != nil {
		s.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	if life > 0 {
		time.Sleep(life)
		if crash {
			s.mu.Lock()
			s.crashes[gen] = true
			s.mu.Unlock()
			src.Crash()
		} else {
			cancel()
		}
	} else {
		deadline := time.Now().Add(2 * time.Minute)
		for {
			st, err := s.br.Stats("q")
			if err != nil {
				s.t.Fatal(err)
			}
			if st.Visible == 0 && st.InFlight == 0 {
				break
			}
			if time.Now().After(deadline) {
				s.violate("the queue never emptied: %+v", st)
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		cancel()
	}
	select {
	case err := <-done:
		if err != nil && !crash {
			s.violate("consumer %d: Run = %v, want nil after a graceful stop", gen, err)
		}
	case <-time.After(time.Minute):
		s.violate("consumer %d: Run did not return within a minute of its stop", gen)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, calls := range s.running {
		for _, c := range calls {
			if c.gen == gen {
				s.violations = append(s.violations, fmt.Sprintf("consumer %d: the handler of %s still runs after Run returned", gen, id))
			}
		}
	}
}

func (s *soak) deadLettered(id string) bool {
	dead, err := s.br.Messages("dlq")
	if err != nil {
		return false
	}
	for _, m := range dead {
		if m.ID == id || m.Headers[adapters.HeaderOriginalID] == id {
			return true
		}
	}
	return false
}

// handle is every consumer's handler: it checks for overlaps, then behaves
// as chosen at random.
func (s *soak) handle(ctx context.Context, gen int, m *consumer.Message) error {
	seq, err := strconv.Atoi(string(m.Body))
	if err != nil {
		s.violate("unexpected body %q", m.Body)
		return consumer.Permanent(err)
	}
	call := &soakCall{gen: gen, ctx: ctx, key: m.Key}
	s.mu.Lock()
	s.seqToID[seq] = m.ID
	// Every other running call that this one must not overlap: the same
	// message anywhere, and the same key where the key orders (across
	// consumers for a FIFO group, within one consumer for OrderByKey).
	var older []*soakCall
	for id, calls := range s.running {
		for _, c := range calls {
			sameKey := c.key == m.Key && (s.cfg.fifo || (s.cfg.byKey && c.gen == gen))
			if c.ctx.Err() == nil && (id == m.ID || sameKey) {
				older = append(older, c)
			}
		}
	}
	s.running[m.ID] = append(s.running[m.ID], call)
	r := s.rng.Float64()
	slow := time.Duration(float64(s.cfg.lease) * (0.5 + s.rng.Float64()))
	s.mu.Unlock()
	for _, o := range older {
		// The older call may be a handler whose lease was lost: its
		// context must end, and at the latest as its lease runs out,
		// which is when the broker could hand the message out again.
		// The margin absorbs a loaded machine's scheduling.
		s.checks.Go(func() {
			select {
			case <-o.ctx.Done():
			case <-time.After(2 * time.Second):
				s.violate("message %s (key %s) ran in consumer %d while an earlier call in consumer %d still ran, its context alive",
					m.ID, m.Key, gen, o.gen)
			}
		})
	}
	defer func() {
		s.mu.Lock()
		calls := s.running[m.ID]
		i := slices.Index(calls, call)
		calls = slices.Delete(calls, i, i+1)
		if len(calls) == 0 {
			delete(s.running, m.ID)
		} else {
			s.running[m.ID] = calls
		}
		s.mu.Unlock()
	}()

	failure := fmt.Errorf("soak: message %d failed", seq)
	switch {
	case r < 0.08:
		return failure
	case r < 0.11:
		panic(failure)
	case r < 0.13:
		return consumer.Permanent(failure)
	case r < 0.17:
		return consumer.RetryAfter(failure, 3*time.Millisecond)
	case r < 0.20 && m.Attempt < 3:
		return consumer.Defer(failure, 3*time.Millisecond)
	case r < 0.25:
		t := time.NewTimer(slow)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			cause := context.Cause(ctx)
			if errors.Is(cause, adapters.ErrLeaseLost) && s.cfg.extendFail == 0 && !s.crashed(gen) {
				// Nothing failed a renewal: the keeper should have kept
				// the lease for as long as the handler ran.
				s.violate("message %s: lease lost in consumer %d although no renewal failed", m.ID, gen)
			}
			return cause
		}
	}
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	s.mu.Lock()
	s.succeeded[m.ID] = true
	s.settledLocked(m.ID, m.Key, seq)
	s.mu.Unlock()
	return nil
}

// settledLocked notes that a handler succeeded for the message, or that it
// was dead-lettered, whichever comes first: the order a FIFO group's
// messages are first settled in is the order their effects are seen in.
// (A message may be handled again later: an ack that failed brings back a
// message already settled, after the group's later messages.)
func (s *soak) settledLocked(id, key string, seq int) {
	if s.settled[id] {
		return
	}
	s.settled[id] = true
	s.firsts[key] = append(s.firsts[key], seq)
}

// soakDeadLetter notes what it dead-letters.
type soakDeadLetter struct {
	adapters.DeadLetter
	s *soak
}

func (dl soakDeadLetter) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	err := dl.DeadLetter.Send(ctx, d, f)
	if err == nil {
		seq, _ := strconv.Atoi(string(d.Body))
		dl.s.mu.Lock()
		dl.s.settledLocked(d.ID, d.Key, seq)
		dl.s.mu.Unlock()
	}
	return err
}
