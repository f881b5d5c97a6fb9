package kafka

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// TestChaosRebalancesLoseNothing runs a group of custody consumers over a
// keyed, multi-partition topic while a producer keeps producing, and starts
// and stops members at random: gracefully (Run's context cancelled), by
// closing the Source under a running runtime, or by a crash (the member's
// handlers stop taking effect, the broker drops its commits from then on, and
// its Source is closed); now and then a member forces a rebalance. Members
// draw their ordering, commit interval, revoke drain, concurrency, unacked
// bounds and metadata limit at random. Handlers succeed, run slow (some
// ignoring their context), fail transiently, or fail for good on a few poison
// records that must reach the dead-letter topic. Once everything is produced a last member
// drains the topic, and the test checks what a user relies on:
//
//  1. nothing is lost: every record's effect happened at least once, or (poison
//     records, and only they) it is in the dead-letter topic; every record was
//     finished (acked while its assignment was live) by some member;
//  2. the group ends committed at the end of every partition;
//  3. no commit request (watched at the broker) passes, or lists as done in its
//     metadata, a record that was not finished before the request arrived;
//     a record handled by a revoked member after the fence does not count;
//     the committed offsets, sampled every 20ms, never move backwards (3b);
//  4. no record listed done in the commit metadata a member read on
//     assignment is handed out again in that assignment, nor one below the
//     committed offset it read; duplicates are counted by cause, and one
//     that neither a crash, a refused or unsent ack, a refused commit nor the
//     metadata limit explains fails the test (4b);
//  5. within one assignment of one member, ByKey and ByPartition lanes run
//     their records one at a time in offset order.
//
// CUSTODY_CHAOS_SEED fixes the seed (logged on every run; the interleaving
// still depends on the scheduler), CUSTODY_CHAOS_ROUNDS sets the number of
// membership changes (8 by default), CUSTODY_CHAOS_VERBOSE=1 logs the
// runtime's messages.
func TestChaosRebalancesLoseNothing(t *testing.T) {
	seed := time.Now().UnixNano()
	if s := os.Getenv("CUSTODY_CHAOS_SEED"); s != "" {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("CUSTODY_CHAOS_SEED=%q: %v", s, err)
		}
		seed = v
	}
	rounds := 8
	if s := os.Getenv("CUSTODY_CHAOS_ROUNDS"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 0 {
			t.Fatalf("CUSTODY_CHAOS_ROUNDS=%q: want a count", s)
		}
		rounds = v
	}
	t.Logf("chaos seed %d, %d rounds (rerun with CUSTODY_CHAOS_SEED=%d CUSTODY_CHAOS_ROUNDS=%d)", seed, rounds, seed, rounds)
	ch := newChaos(t, seed)
	ch.run(rounds)
	ch.verify()
}

const (
	chaosTopic    = "chaos"
	chaosDLQTopic = "chaos.dlq"

	chaosPoisonNone      = 0
	chaosPoisonPermanent = 1 // consumer.Permanent: dead-lettered at once
	chaosPoisonExhaust   = 2 // fails every attempt: dead-lettered after MaxAttempts
)

type chaosTP struct {
	part int32
	off  int64
}

type chaosRecord struct {
	key    string
	poison int
}

// chaosInv is one handler invocation.
type chaosInv struct {
	member, assign int
	part           int32
	off            int64
	key            string
	attempt        int
	start, end     int64 // sequence numbers
	outcome        string
}

// chaosAckEv is one delivery's entry in an Ack call.
type chaosAckEv struct {
	member, assign int
	start          int64 // sequence number taken before the call
	err            error
	crashed        bool // the member had crashed when the call began
}

type chaosCommit struct {
	seq      int64
	name     string // the committing member's client id
	memberID string
	gen      int32
	part     int32
	offset   int64
	meta     string
	dropped  bool // a crashed member's: answered by the test, never applied
}

type chaosFetch struct {
	seq            int64
	member, assign int
	part           int32
	committed      int64
	meta           string
	spans          []span
}

type chaosHandout struct {
	member, assign int
	part           int32
	off            int64
	seq            int64
}

type chaosDLQSend struct {
	member, assign int
	part           int32
	off            int64
	start          int64
	err            error
}

type chaosMemberCfg struct {
	ordering       OrderingScope
	commitInterval time.Duration
	revokeDrain    time.Duration
	maxTotal       int // 0: the default
	maxPerPart     int
	metaLimit      int
	concurrency    int
	runtimeInFl    int
	maxAttempts    int
	backoff        time.Duration
}

func (c chaosMemberCfg) String() string {
	s := fmt.Sprintf("%v commit=%v drain=%v conc=%d attempts=%d", c.ordering, c.commitInterval, c.revokeDrain, c.concurrency, c.maxAttempts)
	if c.maxTotal > 0 {
		s += fmt.Sprintf(" maxInFlight=%d/%d", c.maxPerPart, c.maxTotal)
	}
	if c.metaLimit > 0 {
		s += fmt.Sprintf(" metaLimit=%d", c.metaLimit)
	}
	if c.runtimeInFl > 0 {
		s += fmt.Sprintf(" runtimeInFlight=%d", c.runtimeInFl)
	}
	return s
}

type chaosMember struct {
	idx  int
	name string
	cfg  chaosMemberCfg
	src  atomic.Pointer[Source]
	dl   *DeadLetter
	// crashed is set when the member "dies": its handlers take no more
	// effect, its acks do not count as finished and its commits are dropped.
	crashed  atomic.Bool
	cancel   context.CancelFunc
	done     chan error
	stopping bool   // guarded by chaos.mu
	how      string // how it was stopped
	// Sequence numbers of the stop and of Run's return.
	stopSeq, returnSeq int64
}

type chaos struct {
	t        *testing.T
	seed     int64
	c        *cluster
	group    string
	parts    int32
	topicID  [16]byte
	balancer string
	jittery  bool // a third of the handler runs are slow, not a seventh
	seq      atomic.Int64
	logger   func(t testing.TB) *slog.Logger

	mu           sync.Mutex
	produced     map[chaosTP]chaosRecord
	ends         map[int32]int64
	assigns      map[*partition]int
	assignMember map[int]int
	delivered    map[*kgo.Record]chaosHandout
	handouts     []chaosHandout
	nacks        map[[2]int64]int // (assign, offset) -> nacks
	invs         []chaosInv
	acks         map[chaosTP][]chaosAckEv
	dlqSends     []chaosDLQSend
	commits      []chaosCommit
	samples      []chaosCommit // committed offsets read back while running
	fetches      []chaosFetch
	members      []*chaosMember
	crashedNames map[string]bool
	stopWG       sync.WaitGroup
	actions      []string
}

func newChaos(t *testing.T, seed int64) *chaos {
	rng := rand.New(rand.NewSource(seed))
	ch := &chaos{
		t:            t,
		seed:         seed,
		c:            newCluster(t),
		group:        newGroup(),
		parts:        int32(4 + rng.Intn(3)),
		produced:     map[chaosTP]chaosRecord{},
		ends:         map[int32]int64{},
		assigns:      map[*partition]int{},
		assignMember: map[int]int{},
		delivered:    map[*kgo.Record]chaosHandout{},
		nacks:        map[[2]int64]int{},
		acks:         map[chaosTP][]chaosAckEv{},
		crashedNames: map[string]bool{},
	}
	ch.balancer = "cooperative-sticky"
	if rng.Intn(3) == 0 {
		ch.balancer = "range" // eager: every rebalance revokes everything
	}
	ch.logger = func(testing.TB) *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }
	if os.Getenv("CUSTODY_CHAOS_VERBOSE") != "" {
		ch.logger = func(t testing.TB) *slog.Logger { return testlog.New(t) }
	}
	ch.c.createTopic(t, chaosTopic, ch.parts)
	ch.c.createTopic(t, chaosDLQTopic, 1)
	td, err := ch.c.admin.ListTopics(context.Background(), chaosTopic)
	if err != nil || td[chaosTopic].Err != nil {
		t.Fatalf("listing %s: %v %v", chaosTopic, err, td[chaosTopic].Err)
	}
	ch.topicID = td[chaosTopic].ID
	ch.watchCommits()
	return ch
}

// watchCommits records every offset commit of the group as it reaches the
// broker, and answers a crashed member's commits itself without applying
// them: a dead process commits nothing.
func (ch *chaos) watchCommits() {
	fake := ch.c.fake
	fake.ControlKey(int16(kmsg.OffsetCommit), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		fake.KeepControl()
		req := kreq.(*kmsg.OffsetCommitRequest)
		if req.Group != ch.group {
			return nil, nil, false
		}
		name, _, _ := strings.Cut(req.MemberID, "-")
		seq := ch.seq.Add(1)
		ch.mu.Lock()
		drop := ch.crashedNames[name]
		for _, rt := range req.Topics {
			if rt.Topic != chaosTopic && rt.TopicID != ch.topicID {
				continue
			}
			for _, rp := range rt.Partitions {
				meta := ""
				if rp.Metadata != nil {
					meta = *rp.Metadata
				}
				ch.commits = append(ch.commits, chaosCommit{seq: seq, name: name, memberID: req.MemberID, gen: req.Generation,
					part: rp.Partition, offset: rp.Offset, meta: meta, dropped: drop})
			}
		}
		ch.mu.Unlock()
		if !drop {
			return nil, nil, false
		}
		return offsetCommitResponse(req, 0), nil, true
	})
}

// chaosMix is splitmix64 over vals: handler behaviour is a function of the
// seed and the record (and attempt), not of the interleaving.
func chaosMix(vals ...uint64) uint64 {
	var h uint64 = 0x9e3779b97f4a7c15
	for _, v := range vals {
		h ^= v
		h += 0x9e3779b97f4a7c15
		z := h
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
		z = (z ^ (z >> 27)) * 0x94d049bb133111eb
		h = z ^ (z >> 31)
	}
	return h
}

func (ch *chaos) randomCfg(rng *rand.Rand) chaosMemberCfg {
	cfg := chaosMemberCfg{
		ordering:       OrderingScope(rng.Intn(3)),
		commitInterval: time.Duration(5+rng.Intn(150)) * time.Millisecond,
		revokeDrain:    time.Duration(20+rng.Intn(400)) * time.Millisecond,
		concurrency:    1 + rng.Intn(12),
		maxAttempts:    3 + rng.Intn(3),
		backoff:        time.Duration(1+rng.Intn(15)) * time.Millisecond,
	}
	if rng.Intn(3) == 0 {
		cfg.maxTotal = 2 + rng.Intn(30)
		cfg.maxPerPart = 1 + rng.Intn(cfg.maxTotal)
	}
	if rng.Intn(3) == 0 {
		cfg.metaLimit = minMetadataLimit + rng.Intn(48)
		if rng.Intn(3) > 0 {
			// Out-of-order completions, so that the metadata fills up.
			cfg.ordering = Unordered
			cfg.concurrency = 8 + rng.Intn(16)
		}
	}
	if cfg.maxTotal > 0 && cfg.maxTotal < cfg.concurrency {
		// The runtime refuses a concurrency above what the Source hands out.
		cfg.maxTotal = cfg.concurrency
	}
	switch rng.Intn(4) {
	case 0:
		cfg.runtimeInFl = cfg.concurrency + rng.Intn(8)
	case 1:
		cfg.runtimeInFl = 64 + rng.Intn(192) // many held: long runs of done records beyond a slow one
	}
	return cfg
}

func (ch *chaos) assignID(p *partition, member int) int {
	id, ok := ch.assigns[p]
	if !ok {
		id = len(ch.assigns) + 1
		ch.assigns[p] = id
		ch.assignMember[id] = member
	}
	return id
}

// startMember starts a consumer over a new Source in the group.
func (ch *chaos) startMember(cfg chaosMemberCfg) *chaosMember {
	t := ch.t
	ch.mu.Lock()
	m := &chaosMember{idx: len(ch.members), cfg: cfg, done: make(chan error, 1)}
	m.name = fmt.Sprintf("m%d", m.idx)
	ch.members = append(ch.members, m)
	ch.mu.Unlock()

	balancer := kgo.CooperativeStickyBalancer()
	if ch.balancer == "range" {
		balancer = kgo.RangeBalancer()
	}
	opts := []Option{
		WithOrderingScope(cfg.ordering),
		WithCommitInterval(cfg.commitInterval),
		WithRevokeDrain(cfg.revokeDrain),
		WithClientOptions(kgo.ClientID(m.name), kgo.Balancers(balancer)),
		WithClientFactory(func(opts ...kgo.Opt) (*kgo.Client, error) {
			// Last, so it replaces the Source's own callback, which it calls.
			return kgo.NewClient(append(opts, kgo.OnOffsetsFetched(func(ctx context.Context, cl *kgo.Client, resp *kmsg.OffsetFetchResponse) error {
				s := m.src.Load()
				for s == nil {
					time.Sleep(time.Millisecond)
					s = m.src.Load()
				}
				err := s.onOffsetsFetched(ctx, cl, resp)
				ch.recordFetch(m, s, resp)
				return err
			}))...)
		}),
	}
	if cfg.maxTotal > 0 {
		opts = append(opts, WithMaxUnacked(cfg.maxTotal), WithMaxUnackedPerPartition(cfg.maxPerPart))
	}
	if cfg.metaLimit > 0 {
		opts = append(opts, WithMetadataLimit(cfg.metaLimit))
	}
	src := ch.c.open(t, ch.group, chaosTopic, opts...)
	m.src.Store(src)
	dl := sinkOf(t, src, chaosDLQTopic)
	m.dl = dl
	copts := []consumer.Option{
		consumer.WithName(m.name),
		consumer.WithLogger(ch.logger(t)),
		consumer.WithConcurrency(cfg.concurrency),
		consumer.WithRetry(consumer.Retry{MaxAttempts: cfg.maxAttempts, Backoff: consumer.ConstantBackoff(cfg.backoff)}),
		consumer.WithDeadLetter(&chaosDeadLetter{ch: ch, m: m, inner: dl}),
		consumer.WithShutdownTimeout(5 * time.Second),
	}
	if w := cfg.runtimeInFl; w > 0 {
		if cfg.maxTotal > 0 {
			w = min(w, cfg.maxTotal) // the runtime refuses a window the Source can never fill
		}
		copts = append(copts, consumer.WithMaxInFlight(max(w, cfg.concurrency)))
	}
	cons, err := consumer.New(&chaosSource{ch: ch, m: m, inner: src}, consumer.HandlerFunc(ch.handler(m)), copts...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	m.cancel = cancel
	go func() { m.done <- cons.Run(ctx) }()
	ch.note("start %s (%v)", m.name, cfg)
	return m
}

func (ch *chaos) note(format string, args ...any) {
	ch.mu.Lock()
	ch.actions = append(ch.actions, fmt.Sprintf(format, args...))
	ch.mu.Unlock()
}

// stopMember stops m gracefully, by closing its Source under the running
// runtime, or by a crash, and waits for its Run to return.
func (ch *chaos) stopMember(m *chaosMember, how string) {
	t := ch.t
	m.how = how
	m.stopSeq = ch.seq.Add(1)
	src := m.src.Load()
	switch how {
	case "graceful":
		m.cancel()
	case "crash":
		ch.mu.Lock()
		ch.crashedNames[m.name] = true // from now on its commits are dropped
		ch.mu.Unlock()
		m.crashed.Store(true) // and its handlers take no effect
		fallthrough
	case "close":
		if err := src.Close(); err != nil {
			t.Logf("%s: Close: %v", m.name, err)
		}
	}
	var err error
	select {
	case err = <-m.done:
	case <-time.After(30 * time.Second):
		t.Errorf("%s (%s): Run still running 30s after the stop; cancelling it", m.name, how)
		m.cancel()
		select {
		case err = <-m.done:
		case <-time.After(60 * time.Second):
			t.Errorf("%s (%s): Run never returned", m.name, how)
			return
		}
	}
	m.returnSeq = ch.seq.Add(1)
	m.cancel()
	_ = m.dl.Close()
	if how == "graceful" && err != nil {
		t.Logf("%s: graceful Run returned %v", m.name, err)
	}
}

// chaosSource wraps a member's Source to record what it hands out and what
// its acks do.
type chaosSource struct {
	ch    *chaos
	m     *chaosMember
	inner *Source
}

func (s *chaosSource) Capabilities() adapters.Capabilities { return s.inner.Capabilities() }
func (s *chaosSource) Close() error                        { return s.inner.Close() }

func (s *chaosSource) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	ds, err := s.inner.Receive(ctx, max)
	if len(ds) == 0 {
		return ds, err
	}
	ch := s.ch
	seq := ch.seq.Add(1)
	ch.mu.Lock()
	for _, d := range ds {
		h := d.Handle.(*held)
		ho := chaosHandout{member: s.m.idx, assign: ch.assignID(h.p, s.m.idx), part: d.Partition, off: d.Offset, seq: seq}
		ch.delivered[d.Native.(*kgo.Record)] = ho
		ch.handouts = append(ch.handouts, ho)
	}
	ch.mu.Unlock()
	return ds, err
}

func (s *chaosSource) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	ch := s.ch
	start := ch.seq.Add(1)
	crashed := s.m.crashed.Load()
	err := s.inner.Ack(ctx, ds)
	ch.mu.Lock()
	for i, d := range ds {
		h := d.Handle.(*held)
		k := chaosTP{d.Partition, d.Offset}
		ch.acks[k] = append(ch.acks[k], chaosAckEv{member: s.m.idx, assign: ch.assignID(h.p, s.m.idx), start: start,
			err: adapters.EntryError(err, i), crashed: crashed})
	}
	ch.mu.Unlock()
	return err
}

func (s *chaosSource) Nack(ctx context.Context, ns []adapters.Nack) error {
	ch := s.ch
	ch.mu.Lock()
	for _, n := range ns {
		h := n.Delivery.Handle.(*held)
		ch.nacks[[2]int64{int64(ch.assignID(h.p, s.m.idx)), n.Delivery.Offset}]++
	}
	ch.mu.Unlock()
	return s.inner.Nack(ctx, ns)
}

// chaosDeadLetter records dead-letter writes; a crashed member writes none.
type chaosDeadLetter struct {
	ch    *chaos
	m     *chaosMember
	inner *DeadLetter
}

func (dl *chaosDeadLetter) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	if dl.m.crashed.Load() {
		return errors.New("chaos: the member crashed")
	}
	ch := dl.ch
	start := ch.seq.Add(1)
	err := dl.inner.Send(ctx, d, f)
	ch.mu.Lock()
	ch.dlqSends = append(ch.dlqSends, chaosDLQSend{member: dl.m.idx, assign: ch.assignID(d.Handle.(*held).p, dl.m.idx),
		part: d.Partition, off: d.Offset, start: start, err: err})
	ch.mu.Unlock()
	return err
}

// recordFetch records the committed offsets and metadata m read for a new
// assignment (the Source read them just before, in onOffsetsFetched).
func (ch *chaos) recordFetch(m *chaosMember, s *Source, resp *kmsg.OffsetFetchResponse) {
	seq := ch.seq.Add(1)
	type got struct {
		p         *partition
		part      int32
		committed int64
		meta      string
	}
	var gs []got
	seen := map[int32]bool{} // a response may name a partition twice (Topics and Groups)
	read := func(topic string, part int32, offset int64, meta *string, code int16) {
		if topic != chaosTopic || code != 0 || seen[part] {
			return
		}
		seen[part] = true
		p := s.parts[tpKey{topic, part}]
		if p == nil || p.hasTracked || p.lastPolled >= 0 {
			return // the Source ignores it as well
		}
		g := got{p: p, part: part, committed: offset}
		if meta != nil {
			g.meta = *meta
		}
		gs = append(gs, g)
	}
	s.mu.Lock()
	for _, t := range resp.Topics {
		for _, pt := range t.Partitions {
			read(t.Topic, pt.Partition, pt.Offset, pt.Metadata, pt.ErrorCode)
		}
	}
	for _, g := range resp.Groups {
		for _, t := range g.Topics {
			for _, pt := range t.Partitions {
				read(t.Topic, pt.Partition, pt.Offset, pt.Metadata, pt.ErrorCode)
			}
		}
	}
	s.mu.Unlock()
	ch.mu.Lock()
	defer ch.mu.Unlock()
	for _, g := range gs {
		f := chaosFetch{seq: seq, member: m.idx, assign: ch.assignID(g.p, m.idx), part: g.part, committed: g.committed, meta: g.meta}
		if g.committed >= 0 {
			f.spans = decodeDone(g.meta, g.committed, -1)
		}
		ch.fetches = append(ch.fetches, f)
	}
}

// handler returns m's handler: its behaviour for a record and attempt is a
// function of the seed.
func (ch *chaos) handler(m *chaosMember) func(ctx context.Context, msg *consumer.Message) error {
	return func(ctx context.Context, msg *consumer.Message) error {
		var rec *kgo.Record
		if !msg.As(&rec) {
			ch.t.Errorf("message %s does not carry its *kgo.Record", msg.ID)
			return consumer.Permanent(errors.New("no record"))
		}
		ch.mu.Lock()
		ho, ok := ch.delivered[rec]
		ch.mu.Unlock()
		if !ok {
			ch.t.Errorf("message %s was never handed out by %s", msg.ID, m.name)
		}
		inv := chaosInv{member: m.idx, assign: ho.assign, part: msg.Partition, off: msg.Offset, key: msg.Key,
			attempt: msg.Attempt, start: ch.seq.Add(1)}
		outcome, err := ch.behave(ctx, m, msg)
		inv.end = ch.seq.Add(1)
		inv.outcome = outcome
		ch.mu.Lock()
		ch.invs = append(ch.invs, inv)
		ch.mu.Unlock()
		return err
	}
}

func (ch *chaos) behave(ctx context.Context, m *chaosMember, msg *consumer.Message) (string, error) {
	dead := func() (string, error) {
		<-ctx.Done() // a dead process does nothing more; Close loses the delivery
		return "crashed", context.Cause(ctx)
	}
	if m.crashed.Load() {
		return dead()
	}
	p, off := uint64(msg.Partition), uint64(msg.Offset)
	h := chaosMix(uint64(ch.seed), p, off, uint64(msg.Attempt))
	var slow time.Duration
	switch r := h % 1000; {
	case r < 4:
		slow = time.Duration(400+(h>>10)%800) * time.Millisecond // outlasts most revoke drains
	case r < 15:
		slow = time.Duration(50+(h>>10)%200) * time.Millisecond // may outlast a revoke drain
	case r < 150:
		slow = time.Duration(1+(h>>10)%20) * time.Millisecond
	case ch.jittery && r < 500:
		// Many records finish out of order: the commit metadata fills up.
		slow = time.Duration(2+(h>>10)%25) * time.Millisecond
	}
	stubborn := (h>>20)%3 == 0 // ignores its context
	if slow > 0 {
		if stubborn {
			time.Sleep(slow)
			if (h>>30)%2 == 0 && ctx.Err() != nil {
				// Ignored its context while working, then noticed.
				return "cancelled", context.Cause(ctx)
			}
		} else {
			t := time.NewTimer(slow)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return "cancelled", context.Cause(ctx)
			}
		}
	}
	if m.crashed.Load() {
		return dead()
	}
	switch {
	case strings.HasPrefix(string(msg.Body), "P1"):
		return "poison", consumer.Permanent(errors.New("chaos: poison record"))
	case strings.HasPrefix(string(msg.Body), "P2"):
		return "poison", errors.New("chaos: record that always fails")
	}
	fails := 0
	switch r := chaosMix(uint64(ch.seed), p, off) % 100; {
	case r < 10:
		fails = 1
	case r < 15:
		fails = 2
	}
	if msg.Attempt <= fails {
		return "transient", errors.New("chaos: transient failure")
	}
	return "ok", nil
}

// producer produces keyed batches to random partitions until stop is closed.
func (ch *chaos) producer(rng *rand.Rand, keys int, stop <-chan struct{}) {
	for n := 0; ; n++ {
		select {
		case <-stop:
			return
		default:
		}
		ch.produceBatch(rng, keys, 1+rng.Intn(12), n == 0)
		time.Sleep(time.Duration(10+rng.Intn(40)) * time.Millisecond)
	}
}

func (ch *chaos) produceBatch(rng *rand.Rand, keys, n int, forcePoison bool) {
	rs := make([]*kgo.Record, n)
	for i := range rs {
		poison := chaosPoisonNone
		switch x := rng.Intn(1000); {
		case x < 4 || (forcePoison && i == 0):
			poison = chaosPoisonPermanent
		case x < 8 || (forcePoison && i == 1):
			poison = chaosPoisonExhaust
		}
		rs[i] = &kgo.Record{
			Topic:     chaosTopic,
			Partition: rng.Int31n(ch.parts),
			Key:       []byte("k" + strconv.Itoa(rng.Intn(keys))),
			Value:     []byte(fmt.Sprintf("P%d/%d", poison, rng.Int63())),
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res := ch.c.prod.ProduceSync(ctx, rs...)
	if err := res.FirstErr(); err != nil {
		ch.t.Errorf("producing: %v", err)
		return
	}
	ch.mu.Lock()
	defer ch.mu.Unlock()
	for _, r := range res {
		poison := int(r.Record.Value[1] - '0')
		ch.produced[chaosTP{r.Record.Partition, r.Record.Offset}] = chaosRecord{key: string(r.Record.Key), poison: poison}
		ch.ends[r.Record.Partition] = max(ch.ends[r.Record.Partition], r.Record.Offset+1)
	}
}

func (ch *chaos) live() []*chaosMember {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	var out []*chaosMember
	for _, m := range ch.members {
		if !m.stopping {
			out = append(out, m)
		}
	}
	return out
}

func (ch *chaos) stopAsync(m *chaosMember, how string) {
	ch.mu.Lock()
	m.stopping = true
	ch.mu.Unlock()
	ch.note("stop %s: %s", m.name, how)
	if os.Getenv("CUSTODY_CHAOS_VERBOSE") != "" {
		ch.t.Logf("stop %s: %s", m.name, how)
	}
	ch.stopWG.Add(1)
	go func() {
		defer ch.stopWG.Done()
		ch.stopMember(m, how)
	}()
}

func (ch *chaos) run(rounds int) {
	t := ch.t
	began := time.Now()
	rng := rand.New(rand.NewSource(ch.seed))
	rng.Intn(3) // the draws newChaos made
	rng.Intn(3)
	keys := 3 + rng.Intn(30)
	ch.jittery = rng.Intn(3) == 0
	t.Logf("%d partitions, %d keys, balancer %s, jittery handlers %v", ch.parts, keys, ch.balancer, ch.jittery)

	stopSampling := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		ch.sample(stopSampling)
	}()
	defer func() {
		close(stopSampling)
		<-sampled
	}()

	stopProducing := make(chan struct{})
	produced := make(chan struct{})
	go func() {
		defer close(produced)
		ch.producer(rand.New(rand.NewSource(ch.seed+1)), keys, stopProducing)
	}()

	for i := 1 + rng.Intn(2); i > 0; i-- {
		ch.startMember(ch.randomCfg(rng))
	}
	hows := []string{"graceful", "graceful", "close", "crash", "crash"}
	for r := 0; r < rounds; r++ {
		time.Sleep(time.Duration(200+rng.Intn(900)) * time.Millisecond)
		live := ch.live()
		start := len(live) == 0 || (len(live) < 3 && rng.Intn(2) == 0)
		if start {
			ch.startMember(ch.randomCfg(rng))
			continue
		}
		if rng.Intn(4) == 0 {
			m := live[rng.Intn(len(live))]
			ch.note("rebalance from %s", m.name)
			m.src.Load().Client().ForceRebalance()
			continue
		}
		ch.stopAsync(live[rng.Intn(len(live))], hows[rng.Intn(len(hows))])
	}
	time.Sleep(time.Duration(200+rng.Intn(500)) * time.Millisecond)
	close(stopProducing)
	<-produced
	for _, m := range ch.live() {
		ch.stopAsync(m, hows[rng.Intn(len(hows))])
	}
	ch.stopWG.Wait()

	t.Logf("membership changes done after %v", time.Since(began).Round(time.Millisecond))

	// The last member drains everything.
	ch.mu.Lock()
	ends := make(map[int32]int64, len(ch.ends))
	for p, e := range ch.ends {
		ends[p] = e
	}
	ch.mu.Unlock()
	last := ch.startMember(ch.randomCfg(rng))
	deadline := time.Now().Add(60 * time.Second) // a hang guard
	for {
		offs, _ := ch.c.committed(t, ch.group, chaosTopic)
		caught, past := true, false
		for p := int32(0); p < ch.parts; p++ {
			if offs[p] != ends[p] && !(ends[p] == 0 && offs[p] < 0) {
				caught = false
			}
			past = past || offs[p] > ends[p]
		}
		if caught || past { // past the end: verify says so
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("seed %d: the last member did not commit the end of every partition in 60s: committed %v, ends %v", ch.seed, offs, ends)
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("the last member caught up after %v", time.Since(began).Round(time.Millisecond))
	ch.stopAsync(last, "graceful")
	ch.stopWG.Wait()
}

// sample reads the group's committed offsets every few milliseconds.
func (ch *chaos) sample(stop <-chan struct{}) {
	for {
		select {
		case <-stop:
			return
		case <-time.After(20 * time.Millisecond):
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		resp, err := ch.c.admin.FetchOffsets(ctx, ch.group)
		cancel()
		if err != nil {
			continue
		}
		seq := ch.seq.Add(1)
		ch.mu.Lock()
		for _, r := range resp[chaosTopic] {
			if r.Err == nil && r.At >= 0 {
				ch.samples = append(ch.samples, chaosCommit{seq: seq, name: "sample", part: r.Partition, offset: r.At, meta: r.Metadata})
			}
		}
		ch.mu.Unlock()
	}
}

func inSpans(spans []span, off int64) bool {
	for _, sp := range spans {
		if sp.from <= off && off <= sp.to {
			return true
		}
	}
	return false
}

// chaosReport collects the violations of one invariant, keeping the first
// few for the log.
type chaosReport struct {
	name  string
	n     int
	first []string
}

func (r *chaosReport) add(format string, args ...any) {
	r.n++
	if len(r.first) < 15 {
		r.first = append(r.first, fmt.Sprintf(format, args...))
	}
}

func (ch *chaos) verify() {
	t := ch.t
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if t.Failed() || os.Getenv("CUSTODY_CHAOS_VERBOSE") != "" {
		t.Logf("actions: %s", strings.Join(ch.actions, "; "))
		for _, m := range ch.members {
			t.Logf("%s: stopped (%s) at seq %d, Run returned at %d", m.name, m.how, m.stopSeq, m.returnSeq)
		}
	}
	memberByName := map[string]*chaosMember{}
	for _, m := range ch.members {
		memberByName[m.name] = m
	}

	// The dead-letter topic.
	dlqEnd := int64(0)
	{
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		ends, err := ch.c.admin.ListEndOffsets(ctx, chaosDLQTopic)
		cancel()
		if err != nil {
			t.Fatalf("listing the dead-letter topic's end: %v", err)
		}
		if o, ok := ends.Lookup(chaosDLQTopic, 0); ok {
			dlqEnd = o.Offset
		}
	}
	dlq := map[chaosTP]int{}
	if dlqEnd > 0 {
		for _, r := range ch.c.readTopic(t, chaosDLQTopic, int(dlqEnd)) {
			var k chaosTP
			for _, h := range r.Headers {
				switch h.Key {
				case adapters.HeaderOriginalPart:
					v, _ := strconv.ParseInt(string(h.Value), 10, 32)
					k.part = int32(v)
				case adapters.HeaderOriginalOffset:
					k.off, _ = strconv.ParseInt(string(h.Value), 10, 64)
				}
			}
			dlq[k]++
		}
	}

	// Finished: acked while the assignment was live, by a member that had
	// not crashed. finSeq is the earliest such ack's start.
	finSeq := map[chaosTP]int64{}
	for k, evs := range ch.acks {
		for _, ev := range evs {
			if ev.err == nil && !ev.crashed {
				if s, ok := finSeq[k]; !ok || ev.start < s {
					finSeq[k] = ev.start
				}
			}
		}
	}
	effects := map[chaosTP][]chaosInv{}
	attempts := map[chaosTP]int{}
	outcomes := map[string]int{}
	for _, inv := range ch.invs {
		k := chaosTP{inv.part, inv.off}
		attempts[k]++
		outcomes[inv.outcome]++
		if inv.outcome == "ok" {
			effects[k] = append(effects[k], inv)
		}
	}

	// 1. Nothing is lost; exactly the poison records are dead-lettered.
	loss := &chaosReport{name: "1 loss"}
	var poisons, dlqDup int
	for k, rec := range ch.produced {
		if rec.poison != chaosPoisonNone {
			poisons++
			if dlq[k] == 0 {
				loss.add("poison record %d/%d not in the dead-letter topic (handled %d times)", k.part, k.off, attempts[k])
			}
			if dlq[k] > 1 {
				dlqDup++
			}
		} else {
			if len(effects[k]) == 0 {
				loss.add("record %d/%d never handled successfully (%d invocations)", k.part, k.off, attempts[k])
			}
			if dlq[k] > 0 {
				loss.add("record %d/%d is not poison but is in the dead-letter topic %d times", k.part, k.off, dlq[k])
			}
		}
		if _, ok := finSeq[k]; !ok {
			loss.add("record %d/%d never finished (no ack accepted)", k.part, k.off)
		}
	}
	for k := range dlq {
		if _, ok := ch.produced[k]; !ok {
			loss.add("dead letter for %d/%d, which was never produced", k.part, k.off)
		}
	}

	// 2. The group ends committed at the end of every partition.
	final := &chaosReport{name: "2 final commit"}
	offs, metas := ch.c.committed(t, ch.group, chaosTopic)
	for p := int32(0); p < ch.parts; p++ {
		if offs[p] != ch.ends[p] && !(ch.ends[p] == 0 && offs[p] < 0) {
			final.add("partition %d committed at %d, its end is %d (metadata %q)", p, offs[p], ch.ends[p], metas[p])
		}
	}

	// 3. No commit passes (or lists done) an unfinished record.
	unsafe := &chaosReport{name: "3 commit passes an unfinished record"}
	prefixMax := map[int32][]int64{} // prefixMax[p][n]: latest finish among offsets < n (-1: one is unfinished)
	for p := int32(0); p < ch.parts; p++ {
		pm := make([]int64, ch.ends[p]+1)
		for o := int64(0); o < ch.ends[p]; o++ {
			s, ok := finSeq[chaosTP{p, o}]
			switch {
			case !ok || pm[o] < 0:
				pm[o+1] = -1
			default:
				pm[o+1] = max(pm[o], s)
			}
		}
		prefixMax[p] = pm
	}
	var dropped, checked int
	var maxMeta [2]int    // the largest metadata committed, and its member's limit
	var smallMeta float64 // the fullest metadata of a member with a small limit
	for _, c := range ch.commits {
		if c.dropped {
			dropped++
			continue
		}
		checked++
		m := memberByName[c.name]
		pm := prefixMax[c.part]
		switch {
		case c.offset < 0 || c.offset >= int64(len(pm)):
			unsafe.add("%s committed %d/%d, beyond the partition's end %d", c.name, c.part, c.offset, len(pm)-1)
		case pm[c.offset] < 0 || pm[c.offset] > c.seq:
			first := int64(-1)
			for o := int64(0); o < c.offset; o++ {
				if s, ok := finSeq[chaosTP{c.part, o}]; !ok || s > c.seq {
					first = o
					break
				}
			}
			unsafe.add("%s committed %d/%d (gen %d) at seq %d but offset %d was not finished then (finished at %v)",
				c.name, c.part, c.offset, c.gen, c.seq, first, finSeqStr(finSeq, chaosTP{c.part, first}))
		}
		if c.meta != "" {
			spans := decodeDone(c.meta, c.offset, -1)
			if spans == nil {
				unsafe.add("%s committed %d/%d with metadata %q that does not decode against the offset", c.name, c.part, c.offset, c.meta)
			}
			for _, sp := range spans {
				for o := sp.from; o <= sp.to; o++ {
					if s, ok := finSeq[chaosTP{c.part, o}]; !ok || s > c.seq {
						unsafe.add("%s committed %d/%d with metadata listing %d done, which was not finished then (seq %d, finished at %v)",
							c.name, c.part, c.offset, o, c.seq, finSeqStr(finSeq, chaosTP{c.part, o}))
						break
					}
				}
			}
			limit := DefaultMetadataLimit
			if m != nil && m.cfg.metaLimit > 0 {
				limit = m.cfg.metaLimit
			}
			if len(c.meta) > maxMeta[0] {
				maxMeta = [2]int{len(c.meta), limit}
			}
			if limit < DefaultMetadataLimit && float64(len(c.meta))/float64(limit) > smallMeta {
				smallMeta = float64(len(c.meta)) / float64(limit)
			}
			if len(c.meta) > limit {
				unsafe.add("%s committed metadata of %d bytes, over its limit %d", c.name, len(c.meta), limit)
			}
		}
	}

	backwards := &chaosReport{name: "3b committed offset moves backwards"}
	lastSample := map[int32]chaosCommit{}
	for _, c := range ch.samples {
		if prev, ok := lastSample[c.part]; ok && c.offset < prev.offset {
			backwards.add("partition %d committed %d, then %d (seq %d, %d)", c.part, prev.offset, c.offset, prev.seq, c.seq)
		}
		lastSample[c.part] = c
		pm := prefixMax[c.part]
		if c.offset < int64(len(pm)) && (pm[c.offset] < 0 || pm[c.offset] > c.seq) {
			unsafe.add("sampled committed offset %d/%d at seq %d passes an unfinished record", c.part, c.offset, c.seq)
		}
	}

	// 4. Nothing recorded done in the metadata read on assignment is handed
	// out again in that assignment; duplicates by cause.
	rerun := &chaosReport{name: "4 done record run again"}
	fetchOf := map[int]chaosFetch{}
	for _, f := range ch.fetches {
		if _, ok := fetchOf[f.assign]; ok {
			rerun.add("assignment %d of %s read offsets twice", f.assign, ch.members[f.member].name)
		}
		fetchOf[f.assign] = f
	}
	handed := map[[2]int64]int{}
	skippable := 0
	for _, f := range ch.fetches {
		for _, sp := range f.spans {
			skippable += int(sp.to - sp.from + 1)
		}
	}
	for _, ho := range ch.handouts {
		ak := [2]int64{int64(ho.assign), ho.off}
		handed[ak]++
		if handed[ak] > 1+ch.nacks[ak] {
			rerun.add("%s handed out %d/%d twice in assignment %d without a nack", ch.members[ho.member].name, ho.part, ho.off, ho.assign)
		}
		f, ok := fetchOf[ho.assign]
		if !ok {
			continue
		}
		if f.committed >= 0 && ho.off < f.committed {
			rerun.add("%s handed out %d/%d below the committed offset %d it read (assignment %d)", ch.members[ho.member].name, ho.part, ho.off, f.committed, ho.assign)
		}
		if inSpans(f.spans, ho.off) {
			rerun.add("%s handed out %d/%d, recorded done in the metadata it read (committed %d, spans %v, assignment %d)",
				ch.members[ho.member].name, ho.part, ho.off, f.committed, f.spans, ho.assign)
		}
	}
	redone := &chaosReport{name: "4b done work redone without a crash or a designed limit to explain it"}
	dupCauses := map[string]int{}
	var dupExamples []string
	dupRecords := 0
	for k, es := range effects {
		if len(es) < 2 {
			continue
		}
		dupRecords++
		sort.Slice(es, func(i, j int) bool { return es[i].start < es[j].start })
		for i := 1; i < len(es); i++ {
			cause := ch.dupCause(k, es[i-1], es[i])
			dupCauses[cause]++
			if strings.HasPrefix(cause, "REDONE") {
				redone.add("%d/%d: %s (first by %s in assignment %d, again by %s in assignment %d)", k.part, k.off, cause,
					ch.members[es[i-1].member].name, es[i-1].assign, ch.members[es[i].member].name, es[i].assign)
			}
			if !strings.Contains(cause, "crash") && len(dupExamples) < 10 {
				dupExamples = append(dupExamples, fmt.Sprintf("%d/%d: %s (first by %s (%s) assignment %d [%d,%d], again by %s assignment %d [%d,%d]); acks %+v",
					k.part, k.off, cause, ch.members[es[i-1].member].name, ch.members[es[i-1].member].how, es[i-1].assign, es[i-1].start, es[i-1].end,
					ch.members[es[i].member].name, es[i].assign, es[i].start, es[i].end, ch.acks[k])+ch.history(k))
			}
		}
	}
	dlqCauses := map[string]int{}
	{
		sends := map[chaosTP][]chaosDLQSend{}
		for _, s := range ch.dlqSends {
			if s.err == nil {
				k := chaosTP{s.part, s.off}
				sends[k] = append(sends[k], s)
			}
		}
		for k, ss := range sends {
			for i := 1; i < len(ss); i++ {
				prev := ss[i-1]
				dlqCauses[ch.ackFate(k, prev.member, prev.assign, prev.start)]++
			}
		}
	}

	// 5. Per-lane order within one assignment of one member.
	order := &chaosReport{name: "5 lane order within an assignment"}
	type laneKey struct {
		assign int
		lane   string
	}
	lanes := map[laneKey][]chaosInv{}
	for _, inv := range ch.invs {
		m := ch.members[inv.member]
		var lane string
		switch m.cfg.ordering {
		case ByPartition:
			lane = strconv.Itoa(int(inv.part))
		case ByKey:
			lane = strconv.Itoa(int(inv.part)) + "/" + inv.key
		default:
			continue
		}
		lk := laneKey{inv.assign, lane}
		lanes[lk] = append(lanes[lk], inv)
	}
	for lk, invs := range lanes {
		sort.Slice(invs, func(i, j int) bool { return invs[i].start < invs[j].start })
		for i := 1; i < len(invs); i++ {
			a, b := invs[i-1], invs[i]
			if b.start < a.end {
				order.add("%s lane %s (assignment %d): %d started while %d ran", ch.members[a.member].name, lk.lane, lk.assign, b.off, a.off)
			}
			if b.off < a.off {
				prev := "none"
				for _, f := range ch.fetches {
					if f.member == a.member && f.part == a.part && f.assign < lk.assign {
						prev = strconv.Itoa(f.assign) // this member's earlier assignment of the partition
					}
				}
				order.add("%s lane %s (assignment %d, %v; its previous assignment of the partition: %s): offset %d (nacked %d times in this assignment) ran after %d (%s, attempt %d)",
					ch.members[a.member].name, lk.lane, lk.assign, ch.members[a.member].cfg.ordering, prev,
					b.off, ch.nacks[[2]int64{int64(lk.assign), b.off}], a.off, a.outcome, a.attempt)
			}
		}
	}

	hows := map[string]int{}
	for _, m := range ch.members {
		hows[m.how]++
	}
	t.Logf("produced %d records (%d poison) over %d partitions; %d members (stops: %v); %d handler runs %v",
		len(ch.produced), poisons, ch.parts, len(ch.members), hows, len(ch.invs), outcomes)
	t.Logf("commits seen %d (checked %d, dropped as a crashed member's %d), %d samples; %d assignments, %d with offsets read (%d offsets listed done in metadata read)",
		len(ch.commits), checked, dropped, len(ch.samples), len(ch.assigns), len(ch.fetches), skippable)
	t.Logf("largest commit metadata %d bytes (limit %d); fullest under a small limit: %.0f%%", maxMeta[0], maxMeta[1], 100*smallMeta)
	t.Logf("dead-letter topic: %d records for %d poison records (%d dead-lettered more than once, causes %v)", dlqEnd, poisons, dlqDup, dlqCauses)
	t.Logf("duplicates: %d records handled successfully more than once; causes %v", dupRecords, dupCauses)
	for _, e := range dupExamples {
		t.Logf("  duplicate %s", e)
	}
	failed := false
	for _, r := range []*chaosReport{loss, final, unsafe, backwards, rerun, redone, order} {
		if r.n == 0 {
			continue
		}
		failed = true
		t.Errorf("seed %d: invariant %s: %d violations, first ones:\n  %s", ch.seed, r.name, r.n, strings.Join(r.first, "\n  "))
	}
	if failed {
		t.Logf("actions: %s", strings.Join(ch.actions, "; "))
		t.Logf("rerun with CUSTODY_CHAOS_SEED=%d", ch.seed)
	}
}

// history describes what happened to record k, for the log.
func (ch *chaos) history(k chaosTP) string {
	var b strings.Builder
	for _, ho := range ch.handouts {
		if ho.part == k.part && ho.off == k.off {
			fmt.Fprintf(&b, "\n      handed out by %s in assignment %d at %d", ch.members[ho.member].name, ho.assign, ho.seq)
		}
	}
	for _, inv := range ch.invs {
		if inv.part == k.part && inv.off == k.off {
			fmt.Fprintf(&b, "\n      run by %s in assignment %d [%d,%d] attempt %d: %s", ch.members[inv.member].name, inv.assign, inv.start, inv.end, inv.attempt, inv.outcome)
		}
	}
	for ak, n := range ch.nacks {
		if ak[1] == k.off && ch.assignMember[int(ak[0])] >= 0 {
			fmt.Fprintf(&b, "\n      nacked %d times in assignment %d", n, ak[0])
		}
	}
	return b.String()
}

func finSeqStr(finSeq map[chaosTP]int64, k chaosTP) string {
	if s, ok := finSeq[k]; ok {
		return strconv.FormatInt(s, 10)
	}
	return "never"
}

// ackFate says what became of the ack that followed an effect (or a
// dead-letter write) of member in assignment, started after seq.
func (ch *chaos) ackFate(k chaosTP, member, assign int, after int64) string {
	for _, ev := range ch.acks[k] {
		if ev.member != member || ev.assign != assign || ev.start < after {
			continue
		}
		switch {
		case ev.crashed:
			return "acked after its member crashed"
		case errors.Is(ev.err, adapters.ErrRevoked):
			return "ack refused: partition revoked or lost first"
		case ev.err != nil:
			return "ack failed: " + ev.err.Error()
		}
		if ch.members[member].how == "crash" {
			return "acked, member crashed before committing it"
		}
		return "acked"
	}
	m := ch.members[member]
	switch {
	case m.how == "crash":
		return "not acked: member crashed"
	case m.how == "close" && after > m.stopSeq:
		// The runtime settles a delivery lost for good (here: its Source
		// closed) as lost even when its handler then succeeds.
		return "not acked: handler finished after its Source was closed"
	}
	return "not acked: delivery lost (revoked) before its handler returned"
}

// dupCause classifies the second successful run b of record k after a.
// Causes starting with "REDONE" are failures: done work run again although
// its ack was accepted, its member did not crash, and no designed limit
// explains it.
func (ch *chaos) dupCause(k chaosTP, a, b chaosInv) string {
	if a.assign == b.assign {
		return "REDONE: twice in one assignment"
	}
	fate := ch.ackFate(k, a.member, a.assign, a.end)
	if fate != "acked" && fate != "acked, member crashed before committing it" {
		return fate
	}
	// Acked: was it covered by a commit that reached the broker before b's
	// assignment read its offsets?
	f, ok := ch.fetchFor(b.assign)
	if !ok {
		return "REDONE: acked; the next run's assignment read no offsets"
	}
	covers := func(c chaosCommit) bool {
		return k.off < c.offset || inSpans(decodeDone(c.meta, c.offset, -1), k.off)
	}
	var first, last *chaosCommit
	for i := range ch.commits {
		c := &ch.commits[i]
		if c.dropped || c.part != k.part || c.seq > f.seq {
			continue
		}
		if first == nil && covers(*c) {
			first = c
		}
		if first != nil {
			last = c
		}
	}
	switch {
	case first == nil && fate == "acked":
		return "REDONE: acked by a member that did not crash, never committed before the next owner read offsets"
	case first == nil:
		return fate
	case covers(*last):
		// The last commit covered it, but the next owner read something
		// else: the commit was refused (a stale generation, say).
		return "acked and committed, but the covering commit did not take"
	case last.offset < first.offset:
		return "REDONE: committed, then a later commit moved the offset back below it"
	}
	limit := DefaultMetadataLimit
	if m := ch.memberNamed(last.name); m != nil && m.cfg.metaLimit > 0 {
		limit = m.cfg.metaLimit
	}
	if len(last.meta)+32 > limit {
		// By design: an owner passes on the done offsets it inherited only
		// as far as its metadata limit allows.
		return "listed done in metadata, dropped by a later owner at its metadata limit"
	}
	return "REDONE: listed done in metadata, dropped by a later owner below its metadata limit"
}

func (ch *chaos) memberNamed(name string) *chaosMember {
	for _, m := range ch.members {
		if m.name == name {
			return m
		}
	}
	return nil
}

func (ch *chaos) fetchFor(assign int) (chaosFetch, bool) {
	for _, f := range ch.fetches {
		if f.assign == assign {
			return f, true
		}
	}
	return chaosFetch{}, false
}
