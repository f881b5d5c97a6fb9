package rabbitmq

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/soaktest"
)

// TestSoakKeepsTheInvariants runs the runtime over this adapter, against
// the real broker, through rounds of random configurations (classic or
// quorum queue, prefetch and in-flight bounds, retries waiting in place or
// through delay queues, a dead-letter exchange or the queue's own
// dead-letter exchange, handler and shutdown timeouts),
// handler behaviours (failures, panics, permanent errors, RetryAfter,
// Defer, slow handlers, poison messages that always fail) and faults: TCP
// connections cut under the consumer, its retry publisher and its
// dead-letter sink while handlers run, acks are being written and copies
// wait for their confirm; the consumer's connection or channel closed by the
// client or by the broker; consumers stopped gracefully (at times while
// connections are being cut) or dropped (every connection cut and no
// reconnection allowed); two consumers on the queue at once. Whatever
// happens it checks what a user relies on:
//
//   - nothing is lost: every message is handled successfully at least once
//     or is in the dead-letter queue with its diagnostics, and the queue and
//     its delay queues end empty;
//   - effect, then ack: the runtime acks a delivery only after its handler
//     returned nil or it was dead-lettered (a confirmed copy), and a message
//     no handler succeeded with never disappears without reaching the
//     dead-letter queue (the first check);
//   - poison messages leave the stream, and not before MaxAttempts;
//   - without injected faults no two handlers of one message run at once,
//     no message is handled successfully twice, no ack is dropped and no
//     channel is replaced (the broker closing one would mean a protocol
//     error, an ack of an unknown tag say); with faults, a handler whose
//     delivery was lost has its context cancelled;
//   - no handler runs once its consumer's Run has returned, Run returns
//     (nil after a graceful stop), and no goroutine outlives the round.
//
// Redeliveries after a fault are expected (at least once), and not
// flagged.
//
// Each round logs its seed, its configuration, the faults it injected and
// the adapter's stats, and, when it fails, what the adapter and the runtime
// logged. CUSTODY_RABBITMQ_SOAK_SEED replays a round's choices (the
// interleaving still depends on the scheduler and the broker);
// CUSTODY_RABBITMQ_SOAK_ROUNDS runs more of them (default 2).
func TestSoakKeepsTheInvariants(t *testing.T) {
	soaktest.Rounds(t, "CUSTODY_RABBITMQ_SOAK", 2, soakRound)
}

type soakConfig struct {
	quorum      bool
	native      bool // dead letters go through the queue's own dead-letter exchange
	concurrency int
	prefetch    int
	inFlight    int // 0: the runtime's default
	maxAttempts int
	backoff     time.Duration // the retry policy's, constant
	delayQueues bool          // WithDelayQueues
	timeout     time.Duration // WithHandlerTimeout; 0: none
	leave       bool          // WithLeaveUnfinishedOnShutdown
	lag         time.Duration // the longest pause before each write to the broker
	shutdown    time.Duration // WithShutdownTimeout
	cutEvery    time.Duration // the mean time between cut connections; 0: none
	phases      int           // consumer generations before the last, which runs to the end
}

// soakMessages are published in each round: the first soakUpFront before
// any consumer starts, the rest one by one while the consumers run, so that
// connections are cut in mid-stream.
const (
	soakMessages = 200
	soakUpFront  = 80
)

// soakDelays are the delays handlers ask for with RetryAfter and Defer.
var soakDelays = []time.Duration{3 * time.Millisecond, 150 * time.Millisecond, 400 * time.Millisecond}

func (c soakConfig) String() string {
	return fmt.Sprintf("quorum=%t native=%t concurrency=%d prefetch=%d inFlight=%d maxAttempts=%d backoff=%v delayQueues=%t timeout=%v leave=%t lag=%v shutdown=%v cutEvery=%v phases=%d",
		c.quorum, c.native, c.concurrency, c.prefetch, c.inFlight, c.maxAttempts, c.backoff, c.delayQueues, c.timeout, c.leave, c.lag, c.shutdown, c.cutEvery, c.phases)
}

func soakRound(t *testing.T, seed uint64) {
	// Registered first, so it runs last: after the admin connection and
	// the queues' cleanup.
	leaks := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, leaks) })

	rng := rand.New(rand.NewPCG(seed, 1))
	chance := func(p float64) bool { return rng.Float64() < p }
	cfg := soakConfig{
		quorum:      chance(0.4),
		native:      chance(0.2),
		concurrency: 1 + rng.IntN(8),
		maxAttempts: 2 + rng.IntN(3),
		backoff:     time.Duration(1+rng.IntN(50)) * time.Millisecond,
		shutdown:    time.Duration(rng.IntN(400)) * time.Millisecond,
		phases:      rng.IntN(4),
	}
	if chance(0.1) {
		// With delay queues, every delayed retry goes through one.
		cfg.concurrency, cfg.prefetch = 1, 1
	} else {
		cfg.prefetch = cfg.concurrency + rng.IntN(40)
	}
	if chance(0.5) {
		cfg.inFlight = cfg.concurrency + rng.IntN(cfg.prefetch-cfg.concurrency+1)
	}
	cfg.delayQueues = chance(0.6)
	cfg.leave = chance(0.2)
	if chance(0.2) {
		cfg.timeout = time.Duration(50+rng.IntN(200)) * time.Millisecond
	}
	if chance(0.3) {
		// Slow writes widen the windows a cut can fall into: acks being
		// written, publishes waiting for their confirm.
		cfg.lag = time.Duration(1+rng.IntN(2000)) * time.Microsecond
	}
	if chance(0.6) {
		cfg.cutEvery = time.Duration(50+rng.IntN(400)) * time.Millisecond
	}
	t.Logf("config %s", cfg)

	logs := &soakLog{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("logs of the round:\n%s", logs.String())
		}
	})
	a := newAdmin(t)
	dlq := a.queue(ClassicQueue, nil)
	typ := ClassicQueue
	if cfg.quorum {
		typ = QuorumQueue
	}
	var args amqp.Table
	if cfg.native {
		args = amqp.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq}
	}
	q := a.queue(typ, args)
	for i := range soakUpFront {
		a.publishMsg(q, soakMessage(i))
	}
	s := &soakRun{
		t: t, cfg: cfg, a: a, q: q, dlq: dlq, typ: typ, args: args,
		logger:       slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
		rng:          rand.New(rand.NewPCG(seed, 2)),
		running:      make(map[string][]*soakCall),
		succeeded:    make(map[string]bool),
		successes:    make(map[string]int),
		deadIDs:      make(map[string]bool),
		okDeliveries: make(map[*adapters.Delivery]bool),
		delivered:    make(map[soakKey]*adapters.Delivery),
		cuts:         make(map[int]bool),
		dropped:      make(map[int]bool),
		faulters:     make(map[int]*soakFaults),
		faults:       make(map[string]int),
	}
	defer s.checks.Wait()
	s.published.Add(soakUpFront)

	// The rest of the messages trickle in on a connection of their own.
	pub := newAdmin(t)
	var trickle sync.WaitGroup
	defer trickle.Wait()
	trickle.Go(func() {
		for i := soakUpFront; i < soakMessages; i++ {
			time.Sleep(time.Duration(s.float() * float64(20*time.Millisecond)))
			dc, err := pub.ch.PublishWithDeferredConfirm("", q, true, false, soakMessage(i))
			if err == nil && !dc.Wait() {
				err = errors.New("not confirmed")
			}
			if err != nil {
				s.violate("publish %s: %v", soakID(i), err)
				return
			}
			s.published.Add(1)
		}
	})

	// Earlier generations: one or two consumers at once, each stopped after
	// a while, gracefully or dropped.
	gen := 0
	for range cfg.phases {
		var wg sync.WaitGroup
		for range 1 + rng.IntN(2) {
			gen++
			g, life, drop := gen, time.Duration(200+rng.IntN(1200))*time.Millisecond, chance(0.4)
			wg.Go(func() { s.consume(g, life, drop) })
		}
		wg.Wait()
	}
	// The last one runs until every message is settled and nothing is left.
	gen++
	s.consume(gen, 0, false)
	s.checks.Wait()

	s.mu.Lock()
	for _, v := range s.violations {
		t.Error(v)
	}
	sends := s.deadSends
	s.mu.Unlock()

	// Read the dead-letter queue until it holds every message no handler
	// succeeded with, and every copy the sink confirmed. The native mode's
	// move is the broker's, after it read the reject: wait for it. (That
	// mode has no confirm: a reject written just before a cut may never
	// reach the broker, which then redelivers the message instead.)
	var dead []amqp.Delivery
	deadLettered := make(map[string]bool)
	missing := func() (n int) {
		for i := range soakMessages {
			if id := soakID(i); !s.succeeded[id] && !deadLettered[id] {
				n++
			}
		}
		return n
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		for _, m := range a.drain(dlq) {
			dead = append(dead, m)
			deadLettered[m.MessageId] = true
		}
		if missing() == 0 && (cfg.native || len(dead) >= sends) || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !cfg.native && len(dead) < sends {
		t.Errorf("the dead-letter queue holds %d copies; the sink confirmed %d", len(dead), sends)
	}
	for _, m := range dead {
		h := stringHeaders(m.Headers)
		id := m.MessageId
		if cfg.native {
			if !bytes.Contains([]byte(h["x-death"]), []byte(`"reason":"rejected"`)) {
				t.Errorf("dead-letter copy of %s lacks the broker's x-death: %v", id, h)
			}
			continue
		}
		if h[adapters.HeaderError] == "" || h[adapters.HeaderAttempts] == "" || h[adapters.HeaderOriginalID] != id || h[adapters.HeaderOriginalQueue] != q {
			t.Errorf("dead-letter copy of %s (body %s) lacks its diagnostics: %v", id, m.Body, h)
		}
		seq, _ := strconv.Atoi(string(m.Body))
		if n, _ := strconv.Atoi(h[adapters.HeaderAttempts]); soakPoison(seq) && n < cfg.maxAttempts {
			t.Errorf("poison message %s dead-lettered after %d attempts, before MaxAttempts=%d: %v", id, n, cfg.maxAttempts, h)
		}
	}
	for i := range soakMessages {
		id := soakID(i)
		if !s.succeeded[id] && !deadLettered[id] {
			t.Errorf("message %s was lost: never handled successfully, not dead-lettered", id)
		}
		// Only a fault can bring back a message once it was handled: a
		// graceful stop sends every ack decided.
		if n := s.successes[id]; n > 1 && len(s.faults) == 0 {
			t.Errorf("message %s was handled successfully %d times, with no fault injected", id, n)
		}
	}
	for _, name := range append([]string{q}, soakDelayQueues(q)...) {
		if n := s.depth(name); n > 0 {
			t.Errorf("queue %s holds %d messages at the end", name, n)
		}
	}
	t.Logf("%d consumers, faults %v; %d messages handled, %d dead-letter copies; stats %+v",
		gen, s.faults, len(s.succeeded), len(dead), s.stats)
}

func soakID(i int) string { return "m" + strconv.Itoa(i) }

// soakPoison reports whether message seq is one no handler call succeeds
// with.
func soakPoison(seq int) bool { return seq%25 == 7 }

func soakMessage(i int) amqp.Publishing {
	return amqp.Publishing{MessageId: soakID(i), Body: []byte(strconv.Itoa(i)), DeliveryMode: amqp.Persistent}
}

// soakDelayQueues names the delay queues of q that the round's delays (the
// backoff, soakDelays) can use.
func soakDelayQueues(q string) []string {
	var names []string
	for _, step := range delayLadder {
		names = append(names, delayQueueName(q, step))
		if step >= delayStep(slices.Max(soakDelays)) {
			return names
		}
	}
	return names
}

// soakRun is one round's shared state.
type soakRun struct {
	t            *testing.T
	cfg          soakConfig
	a            *admin
	q, dlq       string
	typ          QueueType
	args         amqp.Table
	logger       *slog.Logger
	checks       sync.WaitGroup // overlap checks still waiting
	mu           sync.Mutex
	rng          *rand.Rand
	running      map[string][]*soakCall // by message ID
	succeeded    map[string]bool        // message IDs a handler returned nil for
	successes    map[string]int         // how often, by message ID
	deadIDs      map[string]bool        // message IDs with a confirmed dead letter
	deadSends    int                    // confirmed dead letters
	okDeliveries map[*adapters.Delivery]bool
	delivered    map[soakKey]*adapters.Delivery // by what a handler sees (see deliveryOf)
	faults       map[string]int                 // faults injected so far, by kind
	cuts         map[int]bool                   // consumers that had a connection cut
	dropped      map[int]bool
	faulters     map[int]*soakFaults // the consumers injecting faults now
	violations   []string
	stats        Stats // the consumers' stats, summed
	published    atomic.Int32
}

// soakCall is one running handler call.
type soakCall struct {
	gen int
	ctx context.Context
	d   *adapters.Delivery
}

func (s *soakRun) violate(format string, args ...any) {
	s.mu.Lock()
	s.violations = append(s.violations, fmt.Sprintf(format, args...))
	s.mu.Unlock()
}

func (s *soakRun) float() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rng.Float64()
}

// depth returns how many messages are ready in queue, 0 if it does not
// exist. A passive declare of a missing queue closes its channel, so each
// asks on a channel of its own. Only the test's goroutine calls it.
func (s *soakRun) depth(queue string) int {
	ch, err := s.a.conn.Channel()
	if err != nil {
		s.t.Fatalf("admin channel: %v", err)
	}
	defer ch.Close()
	st, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return 0
	}
	return st.Messages
}

// settled reports whether every message was handled successfully or
// dead-lettered, and lists those that were not.
func (s *soakRun) unsettled() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for i := range soakMessages {
		if id := soakID(i); !s.succeeded[id] && !s.deadIDs[id] {
			out = append(out, id)
		}
	}
	return out
}

func (s *soakRun) idle() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.running) == 0
}

// held returns how many deliveries src holds unsettled on the wire, or -1
// while it has no channel.
func held(src *Source) int {
	src.mu.Lock()
	g := src.gen
	src.mu.Unlock()
	if g == nil {
		return -1
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.dead {
		return -1
	}
	return len(g.held)
}

// consume runs consumer generation gen for life (when 0, until every
// message is settled and nothing is left anywhere), then stops it: by a
// drop if drop, gracefully otherwise.
func (s *soakRun) consume(gen int, life time.Duration, drop bool) {
	cfg := s.cfg
	logger := s.logger.With("consumer", gen)
	srcDial, sinkDial := &soakDialer{s: s}, &soakDialer{s: s}
	opts := []Option{
		WithDialFunc(srcDial.dial),
		WithLogger(logger),
		WithPrefetch(cfg.prefetch),
		WithReconnectBackoff(10*time.Millisecond, 100*time.Millisecond),
		WithPollWait(50 * time.Millisecond),
	}
	if cfg.native {
		opts = append(opts, WithDeclare(s.typ, s.args))
	}
	if cfg.delayQueues {
		opts = append(opts, WithDelayQueues())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	src, err := New(ctx, s.q, opts...)
	if err != nil {
		s.violate("consumer %d: New: %v", gen, err)
		return
	}
	var sink adapters.DeadLetter
	if cfg.native {
		sink, err = src.NativeDeadLetter()
	} else {
		var x *DeadLetter
		x, err = NewDeadLetter(ctx, "", s.dlq, WithDialFunc(sinkDial.dial), WithLogger(logger))
		if err == nil {
			defer x.Close()
			sink = x
		}
	}
	if err != nil {
		src.Close()
		s.violate("consumer %d: dead-letter destination: %v", gen, err)
		return
	}
	copts := []consumer.Option{
		consumer.WithConcurrency(cfg.concurrency),
		consumer.WithDeadLetter(soakDeadLetter{sink, s, gen}),
		consumer.WithRetry(consumer.Retry{MaxAttempts: cfg.maxAttempts, Backoff: consumer.ConstantBackoff(cfg.backoff)}),
		consumer.WithShutdownTimeout(cfg.shutdown),
		consumer.WithLogger(logger),
	}
	if cfg.timeout > 0 {
		copts = append(copts, consumer.WithHandlerTimeout(cfg.timeout))
	}
	if cfg.leave {
		// The broker requeues what is left when the channel closes.
		copts = append(copts, consumer.WithLeaveUnfinishedOnShutdown())
	}
	if cfg.inFlight > 0 {
		copts = append(copts, consumer.WithMaxInFlight(cfg.inFlight))
	}
	c, err := consumer.New(soakSource{src, s, gen}, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return s.handle(ctx, gen, m)
	}), copts...)
	if err != nil {
		src.Close()
		s.violate("consumer %d: consumer.New: %v", gen, err)
		return
	}
	// Between a retry's confirmed copy and its original's ack, a cut brings
	// the original back beside its copy.
	src.testHookRepublished = func() {
		if f := s.faulter(gen); f != nil && s.float() < 0.1 {
			f.inject(soakCutChannel)
		}
	}
	runCtx, stop := context.WithCancel(context.Background())
	defer stop()
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()

	// Connections are cut at random while the consumer runs, and at times
	// while it stops; the last consumer stops cutting after a while, so
	// that the round can end.
	chaosEnd := make(chan struct{})
	var chaos sync.WaitGroup
	throughStop := life > 0 && !drop && cfg.cutEvery > 0 && s.float() < 0.3
	endChaos := sync.OnceFunc(func() {
		close(chaosEnd)
		chaos.Wait()
		s.mu.Lock()
		delete(s.faulters, gen)
		s.mu.Unlock()
	})
	if cfg.cutEvery > 0 {
		chaosLife := life
		switch {
		case life == 0:
			chaosLife = time.Duration(s.float() * float64(1500*time.Millisecond))
		case throughStop:
			chaosLife = time.Hour // until endChaos
		}
		f := &soakFaults{s: s, gen: gen, src: src, srcDial: srcDial, sinkDial: sinkDial}
		s.mu.Lock()
		s.faulters[gen] = f
		s.mu.Unlock()
		chaos.Go(func() { f.run(chaosLife, chaosEnd) })
	}
	if life > 0 {
		time.Sleep(life)
	} else {
		s.waitSettled(gen, src)
	}
	if !throughStop {
		endChaos()
	}
	if drop {
		// As a process that dies: its connections go, and it never gets
		// another one. The runtime still stops, but can settle nothing.
		s.mu.Lock()
		s.dropped[gen], s.cuts[gen] = true, true
		s.faults["drop"]++
		s.mu.Unlock()
		srcDial.refuse()
		sinkDial.refuse()
		srcDial.cutAll()
		sinkDial.cutAll()
	}
	stop()
	defer endChaos()
	select {
	case err := <-done:
		endChaos()
		s.mu.Lock()
		cut := s.cuts[gen]
		s.mu.Unlock()
		switch {
		case err != nil && drop:
			logger.Info("soak: Run returned an error after the consumer was dropped", "error", err)
		case err != nil:
			// Connections cut earlier are no reason: the adapter
			// reconnected, and a stop is as graceful as any other.
			s.violate("consumer %d: Run = %v, want nil after a graceful stop", gen, err)
		}
		if st := src.Stats(); !cut && (st.Generations > 1 || st.DroppedAcks > 0 || st.AckErrors > 0) {
			s.violate("consumer %d: the channel was replaced, or acks were dropped, although no connection was cut (stats %+v)", gen, st)
		}
	case <-time.After(time.Minute):
		s.violate("consumer %d: Run did not return within a minute of its stop", gen)
		return
	}
	st := src.Stats()
	logger.Info("soak: consumer stopped", "stats", fmt.Sprintf("%+v", st))
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stats = Stats{
		Generations: s.stats.Generations + st.Generations, Delivered: s.stats.Delivered + st.Delivered,
		AckFrames: s.stats.AckFrames + st.AckFrames, MultipleAcks: s.stats.MultipleAcks + st.MultipleAcks,
		Acked: s.stats.Acked + st.Acked, AckErrors: s.stats.AckErrors + st.AckErrors, Rejects: s.stats.Rejects + st.Rejects,
		DroppedAcks: s.stats.DroppedAcks + st.DroppedAcks, Lost: s.stats.Lost + st.Lost,
		DelayQueued: s.stats.DelayQueued + st.DelayQueued, RetryFailures: s.stats.RetryFailures + st.RetryFailures,
		RetriedAtOnce: s.stats.RetriedAtOnce + st.RetriedAtOnce,
	}
	for id, calls := range s.running {
		for _, c := range calls {
			if c.gen == gen {
				s.violations = append(s.violations, fmt.Sprintf("consumer %d: the handler of %s still runs after Run returned", gen, id))
			}
		}
	}
}

// waitSettled returns once every message is settled and nothing is left:
// no handler runs, src holds no delivery, and the queue and its delay
// queues are empty, twice in a row; or, as a violation, after two minutes.
//
// Unsettled messages that are nowhere (none held, none queued, every
// message published) for ten seconds are lost: it returns then, so that a
// loss fails the round sooner. The wait absorbs the broker's requeueing of
// what a closed connection held.
func (s *soakRun) waitSettled(gen int, src *Source) {
	deadline := time.Now().Add(2 * time.Minute)
	var nowhere time.Time
	for quiet := 0; quiet < 2; {
		time.Sleep(50 * time.Millisecond)
		left := s.unsettled()
		h := held(src)
		depth := 0
		for _, name := range append([]string{s.q}, soakDelayQueues(s.q)...) {
			depth += s.depth(name)
		}
		if len(left) == 0 && h == 0 && depth == 0 && s.idle() {
			quiet++
			continue
		}
		quiet = 0
		switch {
		case len(left) == 0 || h != 0 || depth != 0 || !s.idle() || s.published.Load() < soakMessages:
			nowhere = time.Time{}
		case nowhere.IsZero():
			nowhere = time.Now()
		case time.Since(nowhere) > 10*time.Second:
			return // the round reports the messages lost
		}
		if time.Now().After(deadline) {
			s.violate("consumer %d: still unsettled after two minutes: messages %v, %d deliveries held, %d messages queued, stats %+v",
				gen, left, h, depth, src.Stats())
			return
		}
	}
}

// soakFaults injects one consumer's faults.
type soakFaults struct {
	s                 *soakRun
	gen               int
	src               *Source
	srcDial, sinkDial *soakDialer
}

// run injects a fault now and then, for life or until end is closed.
func (f *soakFaults) run(life time.Duration, end <-chan struct{}) {
	over := time.After(life)
	for {
		wait := time.Duration((0.5 + f.s.float()) * float64(f.s.cfg.cutEvery))
		select {
		case <-time.After(wait):
		case <-over:
			return
		case <-end:
			return
		}
		if f.s.float() < 0.03 {
			f.closeFromBroker()
			continue
		}
		f.inject(f.s.float())
	}
}

// closeFromBroker makes the broker close the consumer's connection, as an
// operator would. It takes a second or two (rabbitmqctl), so it is rare.
func (f *soakFaults) closeFromBroker() {
	g := f.begin("broker close")
	if g == nil {
		return
	}
	if err := closeFromBroker(g.conn); err != nil {
		f.s.logger.Info("soak: the broker did not close the connection", "consumer", f.gen, "error", err)
	}
}

// begin notes a fault about to be injected (before it is: the handlers it
// cancels check for it) and returns the consumer's current generation, nil
// while it reconnects.
func (f *soakFaults) begin(kind string) *generation {
	f.s.mu.Lock()
	f.s.cuts[f.gen] = true
	f.s.faults[kind]++
	f.s.mu.Unlock()
	f.src.mu.Lock()
	defer f.src.mu.Unlock()
	return f.src.gen
}

// The faults inject picks for r.
const (
	soakCutChannel   = 0
	soakCutPublisher = 0.7
	soakCutSink      = 0.9
)

// faulter returns consumer gen's fault injector while it injects faults,
// else nil.
func (s *soakRun) faulter(gen int) *soakFaults {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.faulters[gen]
}

// soon injects the fault r picks a moment from now, so that it lands while
// the publish the caller is about to make waits for its confirm.
func (f *soakFaults) soon(r float64) {
	wait := time.Duration(f.s.float() * float64(2*time.Millisecond))
	f.s.checks.Go(func() {
		time.Sleep(wait)
		f.inject(r)
	})
}

// inject cuts one of the consumer's connections, as r (in [0, 1)) picks:
// mostly its channel's (the TCP connection closed under it, as by a network
// failure; or its AMQP connection or channel closed by the client), else
// its retry publisher's or its dead-letter sink's.
func (f *soakFaults) inject(r float64) {
	kinds := []string{"channel's TCP cut", "channel's AMQP connection closed", "channel closed", "publisher's TCP cut", "sink's TCP cut"}
	k := 0
	for _, bound := range []float64{0.45, 0.55, 0.65, 0.8} {
		if r >= bound {
			k++
		}
	}
	g := f.begin(kinds[k])
	switch {
	case g == nil: // reconnecting
	case k == 0:
		f.srcDial.cut(func(c net.Conn) bool { return c.LocalAddr().String() == g.conn.LocalAddr().String() })
	case k == 1:
		_ = g.conn.Close()
	case k == 2:
		_ = g.ch.Close()
	case k == 3:
		f.srcDial.cut(func(c net.Conn) bool { return c.LocalAddr().String() != g.conn.LocalAddr().String() })
	default:
		f.sinkDial.cut(func(net.Conn) bool { return true })
	}
}

// handle is every consumer's handler: it checks for overlaps, then behaves
// as chosen at random.
func (s *soakRun) handle(ctx context.Context, gen int, m *consumer.Message) error {
	seq, err := strconv.Atoi(string(m.Body))
	if err != nil || m.ID != soakID(seq) {
		s.violate("unexpected message %q, body %q", m.ID, m.Body)
		return consumer.Permanent(fmt.Errorf("unexpected body %q", m.Body))
	}
	call := &soakCall{gen: gen, ctx: ctx, d: s.deliveryOf(m)}
	s.mu.Lock()
	var older []*soakCall
	for _, c := range s.running[m.ID] {
		if c.ctx.Err() == nil {
			older = append(older, c)
		}
	}
	s.running[m.ID] = append(s.running[m.ID], call)
	r, cutBefore := s.rng.Float64(), s.rng.Float64() < 0.03
	delay := soakDelays[s.rng.IntN(len(soakDelays))]
	slow := time.Duration(20+s.rng.IntN(300)) * time.Millisecond
	s.mu.Unlock()
	for _, o := range older {
		s.checks.Go(func() { s.checkOverlap(m.ID, o, gen) })
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
	if soakPoison(seq) {
		// Fails every time: it must leave the stream for the dead-letter
		// queue, after MaxAttempts attempts.
		if r < 0.5 {
			panic(failure)
		}
		return failure
	}
	if r >= 0.30 {
		slow = 0
	}
	if err := soaktest.Behave(ctx, seq, m.Attempt, r, slow, delay, func(cause error) { s.cancelled(cause, gen, m) }); err != nil {
		return err
	}
	if f := s.faulter(gen); cutBefore && f != nil {
		// The effect is done; the connection goes before the ack is sent.
		f.inject(soakCutChannel)
	}
	s.mu.Lock()
	s.succeeded[m.ID] = true
	s.successes[m.ID]++
	s.okDeliveries[call.d] = true
	s.mu.Unlock()
	return nil
}

// cancelled checks why a handler's context ended: a lost connection where
// no connection was cut means the channel died of something else.
func (s *soakRun) cancelled(cause error, gen int, m *consumer.Message) {
	s.mu.Lock()
	cut := s.cuts[gen]
	s.mu.Unlock()
	if errors.Is(cause, adapters.ErrConnectionLost) && !cut {
		s.violate("consumer %d: the handler of %s lost its connection although none was cut: %v", gen, m.ID, cause)
	}
}

// checkOverlap checks a handler call of id that started in consumer gen
// while the older call o still ran with its context alive. That older call
// may have lost its delivery (its channel died): its context must then end.
// Otherwise the two may both be live only after a fault: a copy of a retry
// is published before its original is acked, and a connection cut between
// the two (or an ack written and lost with the connection) brings the
// original back beside the copy. The margin absorbs a loaded machine.
func (s *soakRun) checkOverlap(id string, o *soakCall, gen int) {
	select {
	case <-o.ctx.Done():
		return
	case <-time.After(2 * time.Second):
	}
	if cause := o.d.Signal.LostCause(); cause != nil {
		s.violate("message %s: the handler in consumer %d still had a live context two seconds after its delivery was lost (%v)", id, o.gen, cause)
		return
	}
	s.mu.Lock()
	faults := len(s.faults)
	s.mu.Unlock()
	if faults == 0 {
		s.violate("message %s ran in consumer %d while an earlier call in consumer %d still ran, its context alive, with no fault injected", id, gen, o.gen)
	}
}

// soakSource wraps the adapter to check the runtime's acks: the one thing
// the test cannot see on the broker.
type soakSource struct {
	*Source
	s   *soakRun
	gen int
}

// soakKey names a delivery by what its handler can see of it: the array
// behind its body, which amqp091 allocates for each delivery (the native
// delivery's tag repeats on every channel, and the adapter hides the
// channel); soak bodies are never empty.
type soakKey *byte

func soakKeyOf(body []byte) soakKey { return unsafe.SliceData(body) }

// Receive records each delivery, for the handler to find by its message.
func (w soakSource) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	ds, err := w.Source.Receive(ctx, max)
	w.s.mu.Lock()
	for _, d := range ds {
		w.s.delivered[soakKeyOf(d.Body)] = d
	}
	w.s.mu.Unlock()
	return ds, err
}

// deliveryOf returns the delivery behind a handler's message.
func (s *soakRun) deliveryOf(m *consumer.Message) *adapters.Delivery {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.delivered[soakKeyOf(m.Body)]
}

// Nack cuts the retry publisher's connection now and then, while it
// publishes a retry's copy to a delay queue.
func (w soakSource) Nack(ctx context.Context, ns []adapters.Nack) error {
	delayed := false
	for _, n := range ns {
		delayed = delayed || n.After > 0
	}
	if f := w.s.faulter(w.gen); f != nil && delayed && w.s.float() < 0.15 {
		f.soon(soakCutPublisher)
	}
	return w.Source.Nack(ctx, ns)
}

func (w soakSource) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	w.s.mu.Lock()
	for _, d := range ds {
		if !w.s.okDeliveries[d] {
			w.s.violations = append(w.s.violations, fmt.Sprintf("delivery of %s (attempt %d) acked before its handler returned nil or it was dead-lettered", d.ID, d.Attempt))
		}
	}
	w.s.mu.Unlock()
	return w.Source.Ack(ctx, ds)
}

// soakDeadLetter notes what the destination confirmed, and cuts its
// connection now and then while it publishes.
type soakDeadLetter struct {
	adapters.DeadLetter
	s   *soakRun
	gen int
}

func (dl soakDeadLetter) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	if faults := dl.s.faulter(dl.gen); faults != nil && dl.s.float() < 0.15 {
		faults.soon(soakCutSink)
	}
	err := dl.DeadLetter.Send(ctx, d, f)
	if err == nil {
		dl.s.mu.Lock()
		dl.s.deadIDs[d.ID] = true
		dl.s.okDeliveries[d] = true
		dl.s.deadSends++
		dl.s.mu.Unlock()
	}
	return err
}

// soakDialer dials the broker for one consumer's source or sink, and keeps
// the TCP connections so that the test can cut them, as a network failure
// or a broker restart would.
type soakDialer struct {
	s       *soakRun
	mu      sync.Mutex
	conns   []*soakConn
	refused bool
}

// soakConn is a TCP connection that knows when it ended, and pauses before
// each write for up to lag.
type soakConn struct {
	net.Conn
	s     *soakRun
	ended atomic.Bool
}

func (c *soakConn) Write(p []byte) (int, error) {
	if lag := c.s.cfg.lag; lag > 0 {
		time.Sleep(time.Duration(c.s.float() * float64(lag)))
	}
	return c.Conn.Write(p)
}

func (c *soakConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil {
		c.ended.Store(true)
	}
	return n, err
}

func (c *soakConn) Close() error {
	c.ended.Store(true)
	return c.Conn.Close()
}

func (d *soakDialer) dial(ctx context.Context) (*amqp.Connection, error) {
	d.mu.Lock()
	refused := d.refused
	d.mu.Unlock()
	if refused {
		return nil, errors.New("soak: the consumer is gone")
	}
	return amqp.DialConfig(brokerURL, amqp.Config{
		Heartbeat: 10 * time.Second,
		Locale:    "en_US",
		Dial: func(network, addr string) (net.Conn, error) {
			c, err := amqp.DefaultDial(30*time.Second)(network, addr)
			if err != nil {
				return nil, err
			}
			d.mu.Lock()
			defer d.mu.Unlock()
			if d.refused {
				c.Close()
				return nil, errors.New("soak: the consumer is gone")
			}
			sc := &soakConn{Conn: c, s: d.s}
			d.conns = append(d.conns, sc)
			return sc, nil
		},
	})
}

// cut closes the first live connection that pick accepts.
func (d *soakDialer) cut(pick func(net.Conn) bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.conns = slices.DeleteFunc(d.conns, func(c *soakConn) bool { return c.ended.Load() })
	for _, c := range d.conns {
		if pick(c) {
			c.Close()
			return
		}
	}
}

func (d *soakDialer) cutAll() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, c := range d.conns {
		c.Close()
	}
	d.conns = nil
}

func (d *soakDialer) refuse() {
	d.mu.Lock()
	d.refused = true
	d.mu.Unlock()
}

// soakLog keeps a round's log, to show when the round fails.
type soakLog struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *soakLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *soakLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}
