package jetstream

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/soaktest"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// TestSoakJetStreamKeepsTheInvariants runs the runtime over the JetStream
// adapter, on the shared server, through rounds of random configurations
// (concurrency, in-flight window, MaxAttempts, OrderByKey, leaving
// unfinished messages at shutdown, AckWait, the dead-letter subject or the
// consumer's MaxDeliver), handler behaviours (failures, panics, permanent
// errors, RetryAfter, Defer, handlers outliving a third of AckWait or all of
// it), connections killed under running consumers, and consumers that stop,
// crash (their connection is cut and cannot come back, so nothing they hold
// is acked or given back) and overlap. Every consumer reaches the server
// through a proxy of its own. Whatever happens it checks what a user relies
// on:
//
//   - nothing is lost: every message ends handled successfully or dead-
//     lettered (with the consumer's MaxDeliver, left to the server, which
//     says so in a MAX_DELIVERIES advisory), and the consumer ends with
//     nothing pending or unacked (an ack that landed on a message other
//     than the one handled would leave that one acked unhandled);
//   - a dead-letter copy carries its diagnostics and names its original;
//   - no two handlers of one message run at once, nor of one key within a
//     consumer under OrderByKey, unless the older one's context was
//     cancelled (its lease was lost);
//   - no lease is lost in a round without killed connections or crashes;
//   - Run returns after its stop and no handler runs after it returned.
//
// Redeliveries are expected (JetStream is at-least-once) and not flagged.
// Each round logs its seed. CUSTODY_JS_SOAK_SEED replays a round (the choices
// it makes, not the schedule), CUSTODY_JS_SOAK_ROUNDS runs more of them
// (default 2, a few seconds each), CUSTODY_JS_SOAK_LOG=1 shows the runtime's
// log.
func TestSoakJetStreamKeepsTheInvariants(t *testing.T) {
	t.Parallel()
	soaktest.Rounds(t, "CUSTODY_JS_SOAK", 2, jsSoakRound)
}

type jsSoakConfig struct {
	soaktest.Knobs
	native   bool // the consumer's MaxDeliver (NativeDeadLetter), not a dead-letter subject
	ackWait  time.Duration
	messages int
	keys     int
	shutdown time.Duration
	maxFetch int
	cuts     bool // kill connections under running consumers
	phases   int  // consumer generations before the last, which runs to the end
	crash    bool
	overlap  bool
}

type jsSoak struct {
	t      *testing.T
	cfg    jsSoakConfig
	e      *env
	stream string
	dlq    string
	log    *soaktest.Log
	mu     sync.Mutex
	rng    *rand.Rand
	ok     map[int]bool // handled successfully, by sequence number
	dead   map[int]bool // dead-lettered (the sink's Send returned nil)
	// Stream sequences a handler succeeded for (ackable), or the sink was
	// asked to dead-letter (terminable): the soak's proxies check every
	// ack and term on the wire against them.
	ackable, terminable map[uint64]bool
	acksSeen            int
	ids                 map[int]string
	crashed             map[int]bool
	// Stream sequences the server stopped delivering at MaxDeliver (the
	// native dead letter), from its advisories.
	maxDelivered map[uint64]bool
}

func jsSoakRound(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 1))
	chance := func(p float64) bool { return rng.Float64() < p }
	cfg := jsSoakConfig{
		Knobs: soaktest.Knobs{
			ByKey:       chance(0.4),
			Concurrency: 1 + rng.IntN(8),
			MaxAttempts: 2 + rng.IntN(3),
			Leave:       chance(0.2),
		},
		native:   chance(0.3),
		ackWait:  time.Duration(1000+rng.IntN(1000)) * time.Millisecond,
		messages: 20 + rng.IntN(31),
		keys:     3 + rng.IntN(6),
		maxFetch: 1 + rng.IntN(64),
		cuts:     chance(0.4),
		phases:   rng.IntN(4),
		crash:    chance(0.5),
		overlap:  chance(0.5),
	}
	cfg.shutdown = time.Duration(200+rng.IntN(int(cfg.ackWait/time.Millisecond)-200)) * time.Millisecond
	if chance(0.5) {
		cfg.InFlight = cfg.Concurrency + rng.IntN(30)
	}
	t.Logf("config %+v", cfg)

	e := newEnv(t)
	name := uniqueName(t)
	e.stream(name, false)
	s := &jsSoak{
		t: t, cfg: cfg, e: e, stream: name, dlq: name + "_dlq",
		// An earlier call's context must end before the server hands its
		// message out again; a third of AckWait absorbs a loaded
		// machine's scheduling.
		log: soaktest.NewLog(cfg.ackWait / 3),
		rng: rand.New(rand.NewPCG(seed, 2)),
		ok:  map[int]bool{}, dead: map[int]bool{}, ids: map[int]string{},
		crashed: map[int]bool{}, ackable: map[uint64]bool{}, terminable: map[uint64]bool{},
		maxDelivered: map[uint64]bool{},
	}
	// MaxDeliver counts deliveries, not handler runs: a message given back
	// unstarted (at a shutdown, behind a lost message of its key) or lost
	// with a connection uses one up, and may reach the limit without its
	// handler having run MaxAttempts times.
	advisories, err := e.nc.Subscribe("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES."+name+".soak", func(m *nats.Msg) {
		var a struct {
			StreamSeq uint64 `json:"stream_seq"`
		}
		if err := json.Unmarshal(m.Data, &a); err != nil {
			t.Errorf("MAX_DELIVERIES advisory %q: %v", m.Data, err)
			return
		}
		s.mu.Lock()
		s.maxDelivered[a.StreamSeq] = true
		s.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	defer advisories.Unsubscribe()
	if !cfg.native {
		e.stream(s.dlq, false)
	}
	maxDeliver := -1
	if cfg.native {
		maxDeliver = cfg.MaxAttempts
	}
	if _, err := e.js.CreateOrUpdateConsumer(e.ctx(), name, jetstream.ConsumerConfig{
		Durable: "soak", AckPolicy: jetstream.AckExplicitPolicy, AckWait: cfg.ackWait, MaxDeliver: maxDeliver,
	}); err != nil {
		t.Fatal(err)
	}
	for i := range cfg.messages {
		e.publish(fmt.Sprintf("%s.k%d", name, i%cfg.keys), []byte(strconv.Itoa(i)), nil)
	}

	gen := 0
	for range cfg.phases {
		var wg sync.WaitGroup
		n := 1
		if cfg.overlap && chance(0.5) {
			n = 2
		}
		for range n {
			gen++
			g, life, crash := gen, time.Duration(300+rng.IntN(1700))*time.Millisecond, cfg.crash && chance(0.5)
			wg.Go(func() { s.consume(g, life, crash) })
		}
		wg.Wait()
	}
	gen++
	s.consume(gen, 0, false)
	s.log.Wait()

	for _, v := range s.log.Violations() {
		t.Error(v)
	}
	copies := s.readDeadLetters()
	if err := e.nc.Flush(); err != nil { // the advisories published so far
		t.Error(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for seq := range cfg.messages {
		// Published in order on a fresh stream: message seq is stream
		// sequence seq+1.
		if cfg.native && s.maxDelivered[uint64(seq)+1] {
			continue
		}
		if !s.ok[seq] && !s.dead[seq] {
			t.Errorf("message %d (%s) was lost: never handled successfully, not dead-lettered", seq, s.ids[seq])
		}
		if !cfg.native && s.dead[seq] && !copies[seq] {
			t.Errorf("message %d was dead-lettered, but its copy is not in the dead-letter stream", seq)
		}
	}
	if s.acksSeen == 0 {
		t.Errorf("the proxies saw no ack: the effect-then-ack check checked nothing")
	}
	t.Logf("%d consumers; %d handled, %d dead-lettered, %d left at MaxDeliver; %d acks and terms checked on the wire", gen, len(s.ok), len(s.dead), len(s.maxDelivered), s.acksSeen)
}

// consume runs consumer generation gen for life (until the consumer is
// empty, when 0), then stops it, after a crash if crash: its connection is
// cut and refused from then on.
func (s *jsSoak) consume(gen int, life time.Duration, crash bool) {
	px := newWatchingProxy(s.t, strings.TrimPrefix(natsURL(), "nats://"), s.checkSettlement)
	conn := connect(s.t, px.url(), reconnecting()...)
	src, err := New(conn.ctx(), conn.js, s.stream, "soak", WithPollWait(100*time.Millisecond),
		WithRequestTimeout(500*time.Millisecond), WithMaxFetch(s.cfg.maxFetch), WithMaxAttempts(s.cfg.MaxAttempts))
	if err != nil {
		s.log.Violate("consumer %d: New: %v", gen, err)
		return
	}
	var dl adapters.DeadLetter
	if s.cfg.native {
		dl, err = src.NativeDeadLetter(s.cfg.MaxAttempts)
	} else {
		dl, err = NewDeadLetter(conn.ctx(), conn.js, s.dlq+".copies")
	}
	if err != nil {
		s.log.Violate("consumer %d: dead letter: %v", gen, err)
		return
	}
	logger := slog.New(slog.DiscardHandler)
	if os.Getenv("CUSTODY_JS_SOAK_LOG") != "" {
		logger = testlog.New(s.t).With("consumer", gen)
	}
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return s.handle(ctx, gen, m)
	}), s.cfg.Options(soakSink{dl, s}, s.cfg.shutdown, logger)...)
	if err != nil {
		s.log.Violate("consumer %d: consumer.New: %v", gen, err)
		return
	}
	stopCuts := make(chan struct{})
	var cuts sync.WaitGroup
	if s.cfg.cuts {
		cuts.Go(func() {
			for {
				select {
				case <-stopCuts:
					return
				case <-time.After(time.Duration(200+s.intN(1500)) * time.Millisecond):
					px.cut()
				}
			}
		})
	}
	s.log.Drive(gen, c, func(cancel context.CancelFunc) {
		if life == 0 {
			s.waitEmpty()
		} else {
			time.Sleep(life)
			if crash {
				s.mu.Lock()
				s.crashed[gen] = true
				s.mu.Unlock()
				px.down() // for good
			}
		}
		cancel()
	}, func(error) bool { return crash })
	close(stopCuts)
	cuts.Wait()
}

func (s *jsSoak) intN(n int) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rng.IntN(n)
}

// waitEmpty waits until the consumer has nothing pending or unacked, and
// flags it when that takes more than a few minutes.
func (s *jsSoak) waitEmpty() {
	c, err := s.e.js.Consumer(s.e.ctx(), s.stream, "soak")
	if err != nil {
		s.log.Violate("Consumer: %v", err)
		return
	}
	deadline := time.Now().Add(3 * time.Minute)
	for {
		ci, err := c.Info(s.e.ctx())
		if err == nil && ci.NumPending == 0 && ci.NumAckPending == 0 {
			return
		}
		if time.Now().After(deadline) {
			s.log.Violate("the consumer never emptied: %+v, %v", ci, err)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// readDeadLetters returns the sequence numbers of the copies in the
// dead-letter stream, checking their diagnostics.
func (s *jsSoak) readDeadLetters() map[int]bool {
	copies := map[int]bool{}
	if s.cfg.native {
		return copies
	}
	ms, err := s.e.readAll(s.e.ctx(), s.dlq, "")
	if err != nil {
		s.t.Errorf("reading the dead-letter stream: %v", err)
	}
	for _, m := range ms {
		seq, err := strconv.Atoi(string(m.Data()))
		if err != nil {
			s.t.Errorf("dead-letter stream holds a message with body %q", m.Data())
			continue
		}
		copies[seq] = true
		h := m.Headers()
		if h.Get(adapters.HeaderError) == "" || h.Get(adapters.HeaderAttempts) == "" {
			s.t.Errorf("dead-letter copy of message %d lacks its diagnostics: %v", seq, h)
		}
		s.mu.Lock()
		want := s.ids[seq]
		s.mu.Unlock()
		if id := h.Get(adapters.HeaderOriginalID); id != want {
			s.t.Errorf("dead-letter copy of message %d names original %q, want %q", seq, id, want)
		}
	}
	return copies
}

func (s *jsSoak) handle(ctx context.Context, gen int, m *consumer.Message) error {
	seq, err := strconv.Atoi(string(m.Body))
	if err != nil || seq < 0 || seq >= s.cfg.messages {
		s.log.Violate("unexpected body %q", m.Body)
		return consumer.Permanent(fmt.Errorf("bad body %q", m.Body))
	}
	s.mu.Lock()
	s.ids[seq] = m.ID
	r := s.rng.Float64()
	slow := time.Duration(float64(s.cfg.ackWait) * (0.2 + 1.6*s.rng.Float64()))
	s.mu.Unlock()
	if r >= 0.30 {
		slow = 0
	}
	s.log.Received(m.ID, gen)
	end := s.log.Start(&soaktest.Call{Gen: gen, ID: m.ID, Key: m.Key, Ctx: ctx}, func(o *soaktest.Call) bool {
		return o.Key == m.Key && s.cfg.ByKey && o.Gen == gen
	})
	defer end()
	err = soaktest.Behave(ctx, seq, m.Attempt, r, slow, 3*time.Millisecond, func(cause error) {
		s.mu.Lock()
		crashed := s.crashed[gen]
		s.mu.Unlock()
		if errors.Is(cause, adapters.ErrLeaseLost) && !s.cfg.cuts && !crashed {
			s.log.Violate("message %s (body %d): lease lost in consumer %d although no connection was killed: %v", m.ID, seq, gen, cause)
		}
	})
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.ok[seq] = true
	s.ackable[streamSeq(m.ID)] = true
	s.mu.Unlock()
	s.log.Settled(m.ID, m.Key, seq)
	return nil
}

// streamSeq returns the stream sequence of a delivery ID, stream:sequence.
func streamSeq(id string) uint64 {
	n, _ := strconv.ParseUint(id[strings.LastIndexByte(id, ':')+1:], 10, 64)
	return n
}

// checkSettlement flags an ack (or term) a consumer sends for a stream
// sequence no handler succeeded for (nor the sink was asked to
// dead-letter): effect, then ack. A misdirected ack, one landing on
// another message than the one handled, shows here too.
func (s *jsSoak) checkSettlement(subject string, payload []byte) {
	if !strings.HasPrefix(subject, "$JS.ACK.") {
		return
	}
	term := bytes.HasPrefix(payload, ackTerm)
	if !term && !bytes.HasPrefix(payload, ackAck) {
		return
	}
	// $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>,
	// with a domain and an account hash after ACK in the newer form.
	tok := strings.Split(subject, ".")
	i := 5
	if len(tok) >= 12 {
		i = 7
	}
	if len(tok) <= i || tok[i-3] != s.stream {
		return
	}
	seq, err := strconv.ParseUint(tok[i], 10, 64)
	if err != nil {
		s.log.Violate("an ack subject the soak cannot read: %s", subject)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.acksSeen++
	if !s.ackable[seq] && !s.terminable[seq] {
		s.log.Violate("stream sequence %d was %s before a handler succeeded for it or it was dead-lettered (%s)", seq, map[bool]string{false: "acked", true: "terminated"}[term], subject)
	}
}

// soakSink notes what it dead-letters.
type soakSink struct {
	adapters.DeadLetter
	s *jsSoak
}

// SettlesOriginal passes on the sink's answer: both of the package's sinks
// settle the original themselves.
func (dl soakSink) SettlesOriginal(d *adapters.Delivery) bool {
	os, ok := dl.DeadLetter.(adapters.OriginalSettler)
	return ok && os.SettlesOriginal(d)
}

func (dl soakSink) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	// Before the send: the sink terminates the original inside it (and
	// NativeDeadLetter at the last attempt naks it instead).
	dl.s.mu.Lock()
	dl.s.terminable[streamSeq(d.ID)] = true
	dl.s.mu.Unlock()
	err := dl.DeadLetter.Send(ctx, d, f)
	if err == nil {
		seq, _ := strconv.Atoi(string(d.Body))
		dl.s.mu.Lock()
		dl.s.dead[seq] = true
		dl.s.mu.Unlock()
		dl.s.log.Settled(d.ID, d.Key, seq)
	}
	return err
}
