package redisstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/soaktest"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// TestSoakKeepsTheInvariants runs the runtime over this adapter, against the
// real Redis, through rounds of random configurations (leases, blocks, scan
// intervals, XDEL on ack, concurrency and in-flight bounds, attempts,
// shutdown timeouts), handler behaviours (failures, panics, permanent
// errors, RetryAfter and Defer with delays within the lease and beyond it,
// handlers outliving a third of the lease or several leases), faults
// injected under the real client (commands that fail unsent, or whose
// answer is lost after Redis acted: reads, reclaims, acks, renewals,
// give-backs, dead-letter moves; renewals held up, in some consumers of a
// round and not in others), entries deleted from
// the stream while pending or held, and consumers that stop, crash (every
// command fails from then on: nothing they hold is acked or given back) and
// overlap. Whatever happens it checks what a user relies on:
//
//   - nothing is lost: every message not deleted from the stream ends
//     handled or in the dead-letter stream (with its diagnostics), and the
//     group ends with nothing pending and nothing unread;
//   - effect, then ack: no XACK (nor dead-letter move) names an entry no
//     handler succeeded for that was not being dead-lettered;
//   - an entry is never handed out while a call of it still runs with its
//     context alive (another consumer claims it only once its lease was
//     lost), and never handed out empty;
//   - no lease is lost in a consumer whose renewals were neither failed
//     nor held up and that did not crash (in particular, a renewal that
//     reaches Redis late never takes back an entry from the consumer that
//     claimed it meanwhile);
//   - Run returns after its stop, no handler runs after it returned, and no
//     goroutine outlives the round.
//
// Redeliveries are expected (at least once) and not flagged.
//
// Each round logs its seed. CUSTODY_REDIS_SOAK_SEED replays a round (the
// choices it makes, not the schedule), CUSTODY_REDIS_SOAK_ROUNDS runs more
// of them (default 2; a round takes a few seconds), CUSTODY_REDIS_SOAK_LOG=1
// shows the runtime's log.
func TestSoakKeepsTheInvariants(t *testing.T) {
	soaktest.Rounds(t, "CUSTODY_REDIS_SOAK", 2, soakRound)
}

type soakConfig struct {
	soaktest.Knobs
	lease       time.Duration
	block       time.Duration
	interval    time.Duration
	deleteOnAck bool
	messages    int
	shutdown    time.Duration
	// The chance that a command of each kind fails (unsent, or with its
	// answer lost after Redis acted on it).
	readFail, reclaimFail, ackFail, renewFail, nackFail, deadLetterFail float64
	// The chance that a renewal is held up by up to half the lease before
	// it is sent. Where it is not zero, the network of some consumers also
	// stalls once for one to two leases: their renewals sent meanwhile
	// reach Redis only when it ends, after their callers gave up waiting
	// and another consumer may have claimed the entries.
	renewDelay float64
	deletes    int // entries deleted from the stream while the round runs
	phases     int // consumer generations before the last, which runs to the end
	crash      bool
	overlap    bool    // two consumers at once in some earlier generations
	pairs      bool    // two consumers at once in every earlier generation
	slowShare  float64 // the share of the calls that succeed that are slow
}

func soakRound(t *testing.T, seed uint64) {
	// Registered first, so that it runs last, after the clients closed.
	leaks := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, leaks) })

	rng := rand.New(rand.NewPCG(seed, 1))
	chance := func(p float64) bool { return rng.Float64() < p }
	cfg := soakConfig{
		Knobs: soaktest.Knobs{
			Concurrency: 1 + rng.IntN(8),
			MaxAttempts: 2 + rng.IntN(3),
			Leave:       chance(0.2),
		},
		lease:       time.Duration(300+rng.IntN(500)) * time.Millisecond,
		block:       time.Duration(5+rng.IntN(100)) * time.Millisecond,
		deleteOnAck: chance(0.3),
		messages:    40 + rng.IntN(41),
		phases:      rng.IntN(4),
		crash:       chance(0.6),
		overlap:     chance(0.6),
		slowShare:   0.1 + 0.5*rng.Float64(),
	}
	cfg.pairs = cfg.overlap && chance(0.5)
	if cfg.pairs {
		cfg.phases = max(cfg.phases, 1)
	}
	cfg.interval = time.Duration(10+rng.IntN(int(cfg.lease/time.Millisecond)/2)) * time.Millisecond
	cfg.shutdown = time.Duration(rng.IntN(int(cfg.lease/time.Millisecond))) * time.Millisecond
	if chance(0.5) {
		cfg.InFlight = cfg.Concurrency + rng.IntN(40)
	}
	if chance(0.2) {
		cfg.HandlerTimeout = time.Duration(50+rng.IntN(300)) * time.Millisecond
	}
	for _, f := range []*float64{&cfg.readFail, &cfg.reclaimFail, &cfg.ackFail, &cfg.renewFail, &cfg.nackFail, &cfg.deadLetterFail} {
		if chance(0.3) {
			*f = 0.1
		}
	}
	if chance(0.4) {
		cfg.renewDelay = 0.2
	}
	if chance(0.4) {
		cfg.deletes = 1 + rng.IntN(5)
	}
	t.Logf("config %+v", cfg)

	admin := newClient(t, redisAddr())
	e := newEnvOn(t, admin)
	if err := admin.XGroupCreateMkStream(e.ctx(), e.stream, e.group, "0").Err(); err != nil {
		t.Fatal(err)
	}
	s := &soak{
		t: t, cfg: cfg, e: e,
		// An earlier call's context must end before another consumer can
		// claim its entry; a third of the lease absorbs a loaded machine.
		log:       soaktest.NewLog(cfg.lease / 3),
		rng:       rand.New(rand.NewPCG(seed, 2)),
		succeeded: make(map[int]bool),
		ackable:   make(map[string]bool),
		deleted:   make(map[string]bool),
		crashed:   make(map[int]bool),
		faulted:   make(map[int]bool),
		shas: map[string]string{
			extendScript.Hash(): "renew", nackScript.Hash(): "nack",
			reclaimScript.Hash(): "reclaim", deadLetterScript.Hash(): "deadletter",
			cleanupScript.Hash(): "cleanup",
		},
	}
	bodies := make([]string, cfg.messages)
	for i := range bodies {
		bodies[i] = strconv.Itoa(i)
	}
	s.ids = e.publish(bodies...)

	var deleter sync.WaitGroup
	if cfg.deletes > 0 {
		after := time.Duration(rng.IntN(1500)) * time.Millisecond
		picks := rng.Perm(cfg.messages)[:cfg.deletes]
		deleter.Go(func() {
			time.Sleep(after)
			s.mu.Lock()
			var ids []string
			for _, p := range picks {
				ids = append(ids, s.ids[p])
				s.deleted[s.ids[p]] = true
			}
			s.mu.Unlock()
			if err := admin.XDel(context.Background(), e.stream, ids...).Err(); err != nil {
				s.log.Violate("XDEL: %v", err)
			}
		})
	}

	gen := 0
	for range cfg.phases {
		var wg sync.WaitGroup
		n := 1
		if cfg.pairs || cfg.overlap && chance(0.5) {
			n = 2
		}
		for range n {
			gen++
			g, life, crash := gen, time.Duration(200+rng.IntN(1500))*time.Millisecond, cfg.crash && chance(0.5)
			wg.Go(func() { s.consume(g, life, crash) })
		}
		wg.Wait()
	}
	deleter.Wait()
	gen++
	s.consume(gen, 0, false)
	s.log.Wait()

	for _, v := range s.log.Violations() {
		t.Error(v)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	dead := s.readDeadLetters()
	for seq, id := range s.ids {
		if s.deleted[id] {
			continue
		}
		if !s.succeeded[seq] && !dead[seq] {
			t.Errorf("message %d (%s) was lost: never handled successfully, not dead-lettered", seq, id)
		}
	}
	t.Logf("%d consumers; %d handled, %d dead-lettered, %d deleted from the stream; %d faults injected",
		gen, len(s.succeeded), len(dead), len(s.deleted), s.faults.Load())
}

// soak is one round's shared state.
type soak struct {
	t    *testing.T
	cfg  soakConfig
	e    *env
	log  *soaktest.Log
	ids  []string          // entry ids by sequence number
	shas map[string]string // script hashes to names

	faults atomic.Int64

	mu        sync.Mutex
	rng       *rand.Rand
	succeeded map[int]bool
	ackable   map[string]bool // entries handled successfully, or being dead-lettered
	deleted   map[string]bool // entries deleted from the stream
	crashed   map[int]bool
	faulted   map[int]bool // consumers whose renewals the round failed or held up
}

func (s *soak) float() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rng.Float64()
}

// consume runs consumer generation gen for life (until the group has
// nothing left, when 0), then stops it, by a crash if crash: every command
// of its client fails from then on, then its context is cancelled.
func (s *soak) consume(gen int, life time.Duration, crash bool) {
	// Renewals fail or are held up in some consumers only, so that a
	// consumer with a clean network runs beside one without.
	hook := &soakHook{s: s, gen: gen, renewFaults: s.float() < 0.5}
	if hook.renewFaults && s.cfg.renewDelay > 0 {
		span := life
		if span == 0 {
			span = 2 * time.Second
		}
		start := time.Now().Add(time.Duration(s.float() * float64(span)))
		hook.stall = window{start, start.Add(time.Duration((1 + s.float()) * float64(s.cfg.lease)))}
	}
	client := redis.NewClient(&redis.Options{Addr: redisAddr(), PoolSize: 32, MaxRetries: -1})
	client.AddHook(hook)
	defer client.Close()
	logger := slog.New(slog.DiscardHandler)
	if os.Getenv("CUSTODY_REDIS_SOAK_LOG") != "" {
		logger = testlog.New(s.t).With("consumer", gen)
	}
	opts := []Option{
		WithLease(s.cfg.lease), WithBlock(s.cfg.block), WithReclaimInterval(s.cfg.interval),
		WithLogger(logger), WithConsumerCleanup(0),
	}
	if s.cfg.deleteOnAck {
		opts = append(opts, WithDeleteOnAck())
	}
	src, err := New(s.e.ctx(), client, s.e.stream, s.e.group, opts...)
	if err != nil {
		s.log.Violate("consumer %d: New: %v", gen, err)
		return
	}
	dl, err := NewDeadLetter(s.e.ctx(), client, s.e.dlq)
	if err != nil {
		s.log.Violate("consumer %d: NewDeadLetter: %v", gen, err)
		src.Close()
		return
	}
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return s.handle(ctx, gen, m)
	}), s.cfg.Options(soakSink{dl, s}, s.cfg.shutdown, logger)...)
	if err != nil {
		s.log.Violate("consumer %d: consumer.New: %v", gen, err)
		src.Close()
		return
	}
	s.log.Drive(gen, c, func(cancel context.CancelFunc) {
		if life == 0 {
			s.waitDone()
		} else {
			time.Sleep(life)
			if crash {
				s.mu.Lock()
				s.crashed[gen] = true
				s.mu.Unlock()
				hook.dead.Store(true)
			}
		}
		cancel()
	}, func(err error) bool {
		return crash || strings.Contains(err.Error(), injected)
	})
}

// waitDone waits until the group has nothing pending and has read the whole
// stream, and flags it when that takes more than a few minutes.
func (s *soak) waitDone() {
	deadline := time.Now().Add(3 * time.Minute)
	ctx := context.Background()
	for {
		groups, err1 := s.e.client.XInfoGroups(ctx, s.e.stream).Result()
		last, err2 := s.e.client.XRevRangeN(ctx, s.e.stream, "+", "-", 1).Result()
		if err := errors.Join(err1, err2); err != nil {
			s.log.Violate("XINFO GROUPS, XREVRANGE: %v", err)
			return
		}
		// Read up to the last entry left: entries deleted at the end of the
		// stream are never delivered, so the group's last delivered id may
		// stay below the stream's last generated one.
		if len(groups) == 1 && groups[0].Pending == 0 && (len(last) == 0 || !idLess(groups[0].LastDeliveredID, last[0].ID)) {
			return
		}
		if time.Now().After(deadline) {
			s.mu.Lock()
			var missing []int
			for seq, id := range s.ids {
				if !s.succeeded[seq] && !s.deleted[id] {
					missing = append(missing, seq)
				}
			}
			s.mu.Unlock()
			s.log.Violate("the group never finished: %+v; not handled successfully: %v", groups, missing)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// idLess reports whether entry id a comes before b.
func idLess(a, b string) bool {
	am, as, _ := strings.Cut(a, "-")
	bm, bs, _ := strings.Cut(b, "-")
	ami, _ := strconv.ParseUint(am, 10, 64)
	bmi, _ := strconv.ParseUint(bm, 10, 64)
	if ami != bmi {
		return ami < bmi
	}
	asi, _ := strconv.ParseUint(as, 10, 64)
	bsi, _ := strconv.ParseUint(bs, 10, 64)
	return asi < bsi
}

// readDeadLetters returns the sequence numbers of the messages in the
// dead-letter stream, checking their diagnostics. Called with s.mu held.
func (s *soak) readDeadLetters() map[int]bool {
	dead := make(map[int]bool)
	ms, err := s.e.client.XRange(context.Background(), s.e.dlq, "-", "+").Result()
	if err != nil {
		s.t.Errorf("XRANGE of the dead-letter stream: %v", err)
		return dead
	}
	for _, m := range ms {
		body, _ := m.Values[DefaultBodyField].(string)
		seq, err := strconv.Atoi(body)
		if err != nil || seq < 0 || seq >= len(s.ids) {
			s.t.Errorf("dead-letter stream holds an entry with body %q", body)
			continue
		}
		dead[seq] = true
		if m.Values[adapters.HeaderError] == nil || m.Values[adapters.HeaderAttempts] == nil {
			s.t.Errorf("dead-letter copy of message %d lacks its diagnostics: %v", seq, m.Values)
		}
		if id := m.Values[adapters.HeaderOriginalID]; id != s.ids[seq] {
			s.t.Errorf("dead-letter copy of message %d names original %v, want %s", seq, id, s.ids[seq])
		}
	}
	return dead
}

// soakDelays are the delays handlers ask for with RetryAfter and Defer: one
// quick, one within the lease, one beyond it (a parked entry).
func (s *soak) delay(r float64) time.Duration {
	switch {
	case r < 0.5:
		return 3 * time.Millisecond
	case r < 0.8:
		return s.cfg.lease / 2
	}
	return 2 * s.cfg.lease
}

// handle is every consumer's handler: it checks for overlaps, then behaves
// as chosen at random.
func (s *soak) handle(ctx context.Context, gen int, m *consumer.Message) error {
	seq, err := strconv.Atoi(string(m.Body))
	if err != nil || seq < 0 || seq >= len(s.ids) {
		s.log.Violate("consumer %d: entry %s handed out with body %q", gen, m.ID, m.Body)
		return consumer.Permanent(fmt.Errorf("bad body %q", m.Body))
	}
	s.mu.Lock()
	if s.ids[seq] != m.ID {
		s.log.Violate("consumer %d: entry %s carries the body of %s", gen, m.ID, s.ids[seq])
	}
	r := s.rng.Float64()
	// Some outlive a third of the lease, when the runtime renews it, and
	// some several leases.
	slow := time.Duration(float64(s.cfg.lease) * (0.2 + 2*s.rng.Float64()))
	d := s.delay(s.rng.Float64())
	s.mu.Unlock()
	if r >= 0.20+0.80*s.cfg.slowShare {
		slow = 0
	}
	end := s.log.Start(&soaktest.Call{Gen: gen, ID: m.ID, Ctx: ctx}, func(*soaktest.Call) bool { return false })
	defer end()
	err = soaktest.Behave(ctx, seq, m.Attempt, r, slow, d, func(cause error) {
		s.mu.Lock()
		crashed, faulted := s.crashed[gen], s.faulted[gen]
		s.mu.Unlock()
		if errors.Is(cause, adapters.ErrLeaseLost) && !faulted && !crashed {
			s.log.Violate("message %s (body %d): lease lost in consumer %d although no renewal failed: %v", m.ID, seq, gen, cause)
		}
	})
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.succeeded[seq] = true
	s.ackable[m.ID] = true
	s.mu.Unlock()
	s.log.Settled(m.ID, "", seq)
	return nil
}

// soakSink notes what it dead-letters: before the move, since the move acks
// the original.
type soakSink struct {
	adapters.DeadLetter
	s *soak
}

func (dl soakSink) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	dl.s.mu.Lock()
	dl.s.ackable[d.ID] = true
	dl.s.mu.Unlock()
	err := dl.DeadLetter.Send(ctx, d, f)
	if err == nil {
		seq, _ := strconv.Atoi(string(d.Body))
		dl.s.log.Settled(d.ID, "", seq)
	}
	return err
}

// injected is in the text of every fault the soak injects.
const injected = "soak: injected"

// soakHook sits under one consumer's client: it injects the round's
// faults, checks every ack against the handlers' outcomes, and tells the
// log about every entry handed out. Once dead (a crash) it fails every
// command unsent.
type soakHook struct {
	s           *soak
	gen         int
	renewFaults bool   // the round's renewal faults apply to this consumer
	stall       window // when this consumer's network holds its renewals
	dead        atomic.Bool
}

// window is a span of time; the zero value is empty.
type window struct{ start, end time.Time }

func (w window) Contains(t time.Time) bool { return !t.Before(w.start) && t.Before(w.end) }

func (h *soakHook) DialHook(next redis.DialHook) redis.DialHook { return next }

// kind names a command as the round's faults know it.
func (h *soakHook) kind(cmd redis.Cmder) string {
	args := cmd.Args()
	switch name := cmd.Name(); name {
	case "evalsha", "eval":
		if len(args) > 1 {
			if s, ok := args[1].(string); ok {
				if name == "eval" {
					s = redis.NewScript(s).Hash()
				}
				return h.s.shas[s]
			}
		}
	case "xreadgroup":
		return "read"
	case "xack":
		return "ack"
	}
	return ""
}

func (h *soakHook) fault(kind string) (fail, delay float64) {
	c := h.s.cfg
	switch kind {
	case "read":
		return c.readFail, 0
	case "reclaim":
		return c.reclaimFail, 0
	case "ack":
		return c.ackFail, 0
	case "renew":
		if !h.renewFaults {
			return 0, 0
		}
		return c.renewFail, c.renewDelay
	case "nack":
		return c.nackFail, 0
	case "deadletter":
		return c.deadLetterFail, 0
	}
	return 0, 0
}

func (h *soakHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.dead.Load() {
			err := errors.New(injected + " crash: the network is gone")
			cmd.SetErr(err)
			return err
		}
		kind := h.kind(cmd)
		h.checkAcks(kind, cmd)
		fail, delay := h.fault(kind)
		s := h.s
		if kind == "renew" && h.stall.Contains(time.Now()) {
			// Held in the network: the caller's deadline does not stop it.
			h.faulted(kind)
			time.Sleep(time.Until(h.stall.end))
		}
		if delay > 0 && s.float() < delay {
			h.faulted(kind)
			t := time.NewTimer(time.Duration(s.float() * float64(s.cfg.lease) / 2))
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				cmd.SetErr(ctx.Err())
				return ctx.Err()
			}
		}
		lose := fail > 0 && s.float() < fail
		if lose {
			h.faulted(kind)
			if s.float() < 0.5 {
				err := errors.New(injected + " failure: connection refused")
				cmd.SetErr(err)
				return err
			}
		}
		err := next(ctx, cmd)
		if err == nil {
			h.checkHandedOut(kind, cmd)
		}
		if lose {
			// Redis acted; its answer never arrives.
			err := errors.New(injected + " lost answer: connection reset by peer")
			cmd.SetErr(err)
			return err
		}
		return err
	}
}

// faulted counts an injected fault, and notes a renewal's.
func (h *soakHook) faulted(kind string) {
	h.s.faults.Add(1)
	if kind == "renew" {
		h.s.mu.Lock()
		h.s.faulted[h.gen] = true
		h.s.mu.Unlock()
	}
}

func (h *soakHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.dead.Load() {
			err := errors.New(injected + " crash: the network is gone")
			for _, c := range cmds {
				c.SetErr(err)
			}
			return err
		}
		for _, c := range cmds {
			h.checkAcks(h.kind(c), c)
		}
		return next(ctx, cmds)
	}
}

// checkAcks flags every entry an XACK, or a dead-letter move, names that no
// handler succeeded for and that is not being dead-lettered.
func (h *soakHook) checkAcks(kind string, cmd redis.Cmder) {
	args := cmd.Args()
	var ids []any
	switch kind {
	case "ack": // xack stream group id...
		ids = args[3:]
	case "deadletter": // evalsha sha 2 dlq stream group id ...
		if len(args) > 6 {
			ids = args[6:7]
		}
	default:
		return
	}
	s := h.s
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, a := range ids {
		id, _ := a.(string)
		if !s.ackable[id] {
			s.log.Violate("consumer %d: entry %s was acked before a handler succeeded for it or it was dead-lettered", h.gen, id)
		}
	}
}

// checkHandedOut tells the log about the entries a read or a reclaim
// claimed for this consumer: no call of them may still run with its
// context alive.
func (h *soakHook) checkHandedOut(kind string, cmd redis.Cmder) {
	var ids []string
	switch kind {
	case "read":
		c, ok := cmd.(*redis.XStreamSliceCmd)
		if !ok {
			return
		}
		for _, st := range c.Val() {
			for _, m := range st.Messages {
				ids = append(ids, m.ID)
			}
		}
	case "reclaim":
		c, ok := cmd.(*redis.Cmd)
		if !ok {
			return
		}
		res, _ := c.Slice()
		if r, err := parseReclaim(res); err == nil {
			for _, e := range r.entries {
				ids = append(ids, e.msg.ID)
			}
		}
	}
	for _, id := range ids {
		h.s.log.Received(id, h.gen)
	}
}
