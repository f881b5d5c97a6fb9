package consumer_test

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
	"github.com/custody-go/custody/internal/testkit/soaktest"
)

// TestSoakKeepsTheInvariants runs the runtime on the memory broker through
// rounds of random configurations (queue type, ordering, concurrency,
// in-flight bound, lease, attempts, handler timeout, leaving unfinished
// messages at shutdown), handler behaviours (failures, panics,
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
	soaktest.Rounds(t, "CUSTODY_SOAK", 4, soakRound)
}

type soakConfig struct {
	soaktest.Knobs
	fifo       bool
	lease      time.Duration
	ackFail    float64 // the chance that an ack of a delivery fails
	extendFail float64 // the chance that a renewal of a delivery fails
	phases     int     // consumer generations before the last, which runs to the end
}

const (
	soakMessages = 150
	soakKeys     = 8
)

func soakRound(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 1))
	chance := func(p float64) bool { return rng.Float64() < p }
	cfg := soakConfig{
		fifo: chance(0.4),
		Knobs: soaktest.Knobs{
			ByKey:       chance(0.5),
			Concurrency: 1 + rng.IntN(8),
			MaxAttempts: 2 + rng.IntN(3),
		},
		lease:  time.Duration(400+rng.IntN(400)) * time.Millisecond,
		phases: rng.IntN(4),
	}
	if chance(0.5) {
		cfg.InFlight = cfg.Concurrency + rng.IntN(40)
	}
	if chance(0.5) {
		cfg.ackFail = 0.05
	}
	if chance(0.3) {
		cfg.extendFail = 0.3
	}
	cfg.Leave = chance(0.3)
	if chance(0.3) {
		cfg.HandlerTimeout = cfg.lease // slow handlers run up to 1.5 leases
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
		// The margin absorbs a loaded machine's scheduling.
		log:       soaktest.NewLog(2 * time.Second),
		rng:       rand.New(rand.NewPCG(seed, 2)),
		succeeded: make(map[string]bool),
		crashes:   make(map[int]bool),
	}
	defer s.log.Wait()

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
	s.log.Wait()

	s.mu.Lock()
	defer s.mu.Unlock()
	for _, v := range s.log.Violations() {
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
		for key, seqs := range s.log.Unordered() {
			t.Errorf("FIFO group %s first settled in the order %v, want publish order", key, seqs)
		}
	}
	t.Logf("%d consumers; %d handled, %d dead-lettered", gen, len(s.succeeded), len(dead))
}

// soak is one round's shared state.
type soak struct {
	t   *testing.T
	cfg soakConfig
	br  *memory.Broker
	log *soaktest.Log

	mu        sync.Mutex
	rng       *rand.Rand
	succeeded map[string]bool
	seqToID   [soakMessages]string
	crashes   map[int]bool // consumers whose source crashed
}

func (s *soak) violate(format string, args ...any) { s.log.Violate(format, args...) }

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
	opts := s.cfg.Options(soakDeadLetter{dlq, s}, s.cfg.lease, slog.New(slog.DiscardHandler))
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return s.handle(ctx, gen, m)
	}), opts...)
	if err != nil {
		s.t.Fatal(err)
	}
	s.log.Drive(gen, c, func(cancel context.CancelFunc) {
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
			return
		}
		s.log.AwaitEmpty(s.br, "q", 2*time.Minute)
		cancel()
	}, func(error) bool { return crash })
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
	s.mu.Lock()
	s.seqToID[seq] = m.ID
	r := s.rng.Float64()
	slow := time.Duration(float64(s.cfg.lease) * (0.5 + s.rng.Float64()))
	s.mu.Unlock()
	if r >= 0.25 {
		slow = 0
	}
	// The same key must not overlap where the key orders: across consumers
	// for a FIFO group, within one consumer for OrderByKey.
	end := s.log.Start(&soaktest.Call{Gen: gen, ID: m.ID, Key: m.Key, Ctx: ctx}, func(o *soaktest.Call) bool {
		return o.Key == m.Key && (s.cfg.fifo || (s.cfg.ByKey && o.Gen == gen))
	})
	defer end()
	err = soaktest.Behave(ctx, seq, m.Attempt, r, slow, 3*time.Millisecond, func(cause error) {
		if errors.Is(cause, adapters.ErrLeaseLost) && s.cfg.extendFail == 0 && !s.crashed(gen) {
			// Nothing failed a renewal: the keeper should have kept the
			// lease for as long as the handler ran.
			s.violate("message %s: lease lost in consumer %d although no renewal failed", m.ID, gen)
		}
	})
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.succeeded[m.ID] = true
	s.mu.Unlock()
	s.log.Settled(m.ID, m.Key, seq)
	return nil
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
		dl.s.log.Settled(d.ID, d.Key, seq)
	}
	return err
}
