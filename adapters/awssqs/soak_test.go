package awssqs

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"go.uber.org/goleak"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/soaktest"
	"github.com/custody-go/custody/internal/testkit/sqsemu"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// TestSoakSQSKeepsTheInvariants runs the runtime over the SQS adapter, on the
// emulator, through rounds of random configurations (standard and FIFO
// queues, the DeadLetter sink or the queue's own redrive policy, pollers,
// batch sizes, lingers), handler behaviours (failures, panics, permanent
// errors, RetryAfter, Defer, handlers outliving a third of the visibility
// timeout or all of it), request faults injected under the real client (SQS
// calls that fail before they are sent, whose answer is lost after SQS acted,
// or that are held up), and consumers that stop, crash (their network goes
// dead, so nothing they hold is deleted or released) and overlap. Whatever
// happens it checks what a user relies on:
//
//   - nothing is lost: every message ends handled or in the dead-letter
//     queue (with its diagnostics, for the sink), and the queue ends empty;
//   - effect, then ack: no DeleteMessageBatch names a receipt handle whose
//     delivery was not handled successfully or dead-lettered;
//   - no two handlers of one message run at once, nor of one key within a
//     consumer (a FIFO group, or OrderByKey), unless the older one's context
//     was cancelled (its lease was lost);
//   - no lease is lost when no visibility change failed or was held up;
//   - where the emulator allows the check (see below), a FIFO group's
//     messages are first settled in publish order;
//   - Run returns after its stop, no handler runs after it returned, and no
//     goroutine outlives the round.
//
// Redeliveries are expected (SQS is at-least-once) and not flagged.
//
// The emulator does not block a FIFO group while one of its messages is in
// flight: it hands out a group's later messages beside an earlier one that
// is invisible with another consumer, or with no one (its holder crashed, its
// lease was lost, a receive's answer was lost; it ignores
// ReceiveRequestAttemptId too). Real SQS does not. So FIFO rounds either
// check group order and exclusivity across consumers with the faults that
// would leave a message invisible out of its group's turn switched off, or
// run every fault and check exclusivity within each consumer only.
//
// Each round logs its seed. CUSTODY_SQS_SOAK_SEED replays a round (the
// choices it makes, not the schedule), CUSTODY_SQS_SOAK_ROUNDS runs more of
// them (default 2, since a round takes 5 to 30 s), CUSTODY_SQS_SOAK_LOG=1
// shows the runtime's log.
func TestSoakSQSKeepsTheInvariants(t *testing.T) {
	soaktest.Rounds(t, "CUSTODY_SQS_SOAK", 2, sqsSoakRound)
}

type sqsSoakConfig struct {
	soaktest.Knobs
	fifo        bool
	orderCheck  bool // FIFO only: faults restricted so the emulator keeps group order
	redrive     bool // the queue's redrive policy (Source.NativeDeadLetter), not the DeadLetter sink
	visibility  time.Duration
	messages    int
	keys        int
	shutdown    time.Duration
	pollers     int // 0: the Source's default
	maxMessages int
	ackLinger   time.Duration
	nackLinger  time.Duration
	sdkRetries  bool // the SDK's default retryer; otherwise one attempt per call

	// The chance that a request of each kind fails (before it is sent, or
	// with its answer lost after SQS acted on it).
	deleteFail, visibilityFail, receiveFail, sendFail float64
	// The chance that a visibility change, or a delete, is held up, by up
	// to half the visibility timeout.
	visibilityDelay, deleteDelay float64

	phases  int // consumer generations before the last, which runs to the end
	crash   bool
	overlap bool
}

func sqsSoakRound(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 1))
	chance := func(p float64) bool { return rng.Float64() < p }
	cfg := sqsSoakConfig{
		Knobs: soaktest.Knobs{
			ByKey:       chance(0.4),
			Concurrency: 1 + rng.IntN(8),
			MaxAttempts: 2 + rng.IntN(3),
		},
		fifo:        chance(0.4),
		redrive:     chance(0.35),
		visibility:  time.Duration(2+rng.IntN(2)) * time.Second,
		messages:    40 + rng.IntN(41),
		keys:        3 + rng.IntN(6),
		maxMessages: 1 + rng.IntN(10),
		ackLinger:   time.Duration(rng.IntN(40)) * time.Millisecond,
		nackLinger:  time.Duration(rng.IntN(20)) * time.Millisecond,
		sdkRetries:  chance(0.5),
		phases:      rng.IntN(4),
		crash:       chance(0.6),
		overlap:     chance(0.6),
	}
	cfg.shutdown = time.Duration(300+rng.IntN(int(cfg.visibility/time.Millisecond)-300)) * time.Millisecond
	if chance(0.5) {
		cfg.InFlight = cfg.Concurrency + rng.IntN(30)
	}
	if chance(0.4) {
		cfg.pollers = 1 + rng.IntN(4)
	}
	if chance(0.5) {
		cfg.deleteFail = 0.15
	}
	if chance(0.4) {
		cfg.visibilityFail = 0.15
	}
	if chance(0.3) {
		cfg.visibilityDelay = 0.1
	}
	if chance(0.3) {
		cfg.deleteDelay = 0.1
	}
	if chance(0.4) {
		cfg.receiveFail = 0.1
	}
	if chance(0.4) {
		cfg.sendFail = 0.2
	}
	if cfg.fifo {
		cfg.pollers = 0 // one poll at a time: see WithPollers
		cfg.orderCheck = chance(0.5)
	}
	if cfg.orderCheck {
		// Each of these leaves a message invisible out of its group's
		// turn, which the emulator, unlike SQS, lets the group's later
		// messages overtake.
		cfg.crash, cfg.overlap = false, false
		cfg.visibilityFail, cfg.visibilityDelay, cfg.receiveFail = 0, 0, 0
	}
	t.Logf("config %+v", cfg)

	e := newEnv(t)
	// After newEnv: the emulator's own goroutines start with it.
	before := goleak.IgnoreCurrent()
	dlqURL, dlqARN := e.queue(cfg.fifo, 30*time.Second, nil)
	var attrs map[string]string
	if cfg.redrive {
		attrs = map[string]string{"RedrivePolicy": redrivePolicyJSON(dlqARN, cfg.MaxAttempts)}
	}
	url, _ := e.queue(cfg.fifo, cfg.visibility, attrs)
	base := &http.Transport{MaxIdleConnsPerHost: 64}
	s := &sqsSoak{
		t: t, cfg: cfg, e: e, url: url, dlqURL: dlqURL, base: base,
		endpoint: sqsemu.Start(t),
		// An earlier call's context must end before SQS can hand its
		// message out again; a third of the visibility timeout absorbs a
		// loaded machine's scheduling.
		log:       soaktest.NewLog(cfg.visibility / 3),
		rng:       rand.New(rand.NewPCG(seed, 2)),
		succeeded: make(map[string]bool),
		ackable:   make(map[string]bool),
		seqToID:   make([]string, cfg.messages),
	}
	s.publish()

	// Earlier generations: one consumer, or two at once, each stopped after
	// a while, gracefully or by a crash.
	gen := 0
	for range cfg.phases {
		var wg sync.WaitGroup
		n := 1
		if cfg.overlap && chance(0.5) {
			n = 2
		}
		for range n {
			gen++
			g, life, crash := gen, time.Duration(300+rng.IntN(2700))*time.Millisecond, cfg.crash && chance(0.5)
			wg.Go(func() { s.consume(g, life, crash) })
		}
		wg.Wait()
	}
	// The last one runs until every message is settled.
	gen++
	s.consume(gen, 0, false)
	s.log.Wait()

	s.mu.Lock()
	defer s.mu.Unlock()
	for _, v := range s.log.Violations() {
		t.Error(v)
	}
	deadLettered := s.readDeadLetters()
	for seq, id := range s.seqToID {
		if id == "" && !cfg.redrive {
			// The redrive policy may move a message that never reached a
			// handler: every receive counts, even one given back at a
			// shutdown before its handler started.
			t.Errorf("message %d was never handed to a handler", seq)
		}
		if !s.succeeded[strconv.Itoa(seq)] && !deadLettered[seq] {
			t.Errorf("message %d (%s) was lost: never handled successfully, not dead-lettered", seq, id)
		}
	}
	if cfg.orderCheck {
		for key, seqs := range s.log.Unordered() {
			t.Errorf("FIFO group %s first settled in the order %v, want publish order", key, seqs)
		}
	}
	t.Logf("%d consumers; %d handled, %d dead-lettered; requests: %d deletes, %d visibility changes, %d receives; %d faults injected",
		gen, len(s.succeeded), len(deadLettered), s.deleteCalls.Load(), s.visibilityCalls.Load(), s.receiveCalls.Load(), s.faults.Load())

	base.CloseIdleConnections()
	if err := goleak.Find(before,
		goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	); err != nil {
		t.Errorf("goroutines outlived the round: %v", err)
	}
}

// sqsSoak is one round's shared state.
type sqsSoak struct {
	t        *testing.T
	cfg      sqsSoakConfig
	e        *env
	url      string
	dlqURL   string
	endpoint string
	base     *http.Transport
	log      *soaktest.Log

	faults, deleteCalls, visibilityCalls, receiveCalls atomic.Int64

	mu        sync.Mutex
	rng       *rand.Rand
	succeeded map[string]bool // by body (the sequence number)
	ackable   map[string]bool // receipt handles handled successfully or dead-lettered
	seqToID   []string
	crashed   map[int]bool
}

func (s *sqsSoak) violate(format string, args ...any) { s.log.Violate(format, args...) }

func (s *sqsSoak) float() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rng.Float64()
}

// publish sends the round's messages in order, their bodies their sequence
// numbers, their group (the key on a standard queue) one of cfg.keys.
func (s *sqsSoak) publish() {
	for start := 0; start < s.cfg.messages; start += maxBatch {
		var entries []types.SendMessageBatchRequestEntry
		for i := start; i < min(start+maxBatch, s.cfg.messages); i++ {
			entries = append(entries, types.SendMessageBatchRequestEntry{
				Id:             aws.String(strconv.Itoa(i)),
				MessageBody:    aws.String(strconv.Itoa(i)),
				MessageGroupId: aws.String(fmt.Sprintf("k%d", i%s.cfg.keys)),
			})
		}
		out, err := s.e.client.SendMessageBatch(s.e.ctx(), &sqs.SendMessageBatchInput{QueueUrl: aws.String(s.url), Entries: entries})
		if err != nil {
			s.t.Fatalf("SendMessageBatch: %v", err)
		}
		if len(out.Failed) > 0 {
			s.t.Fatalf("SendMessageBatch: %d entries failed: %s", len(out.Failed), aws.ToString(out.Failed[0].Message))
		}
	}
}

// consume runs consumer generation gen for life (until every message is
// settled, when 0), then stops it, by a crash if crash: its network goes
// dead, then its context is cancelled.
func (s *sqsSoak) consume(gen int, life time.Duration, crash bool) {
	tr := &soakTransport{s: s, base: s.base, gen: gen}
	o := sqs.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String(s.endpoint),
		Credentials:  credentials.NewStaticCredentialsProvider("fake", "fake", ""),
		HTTPClient:   &http.Client{Transport: tr},
	}
	if !s.cfg.sdkRetries {
		// Every failure reaches the adapter, rather than the few that
		// outlast the SDK's three attempts.
		o.RetryMaxAttempts = 1
	}
	client := sqs.New(o)
	opts := testOptions(WithMaxMessages(s.cfg.maxMessages), WithAckLinger(s.cfg.ackLinger), WithNackLinger(s.cfg.nackLinger))
	if s.cfg.pollers > 0 {
		opts = append(opts, WithPollers(s.cfg.pollers))
	}
	src, err := New(s.e.ctx(), client, s.url, opts...)
	if err != nil {
		s.violate("consumer %d: New: %v", gen, err)
		return
	}
	var dl adapters.DeadLetter
	if s.cfg.redrive {
		if dl, err = src.NativeDeadLetter(s.cfg.MaxAttempts); err != nil {
			s.violate("consumer %d: NativeDeadLetter: %v", gen, err)
			return
		}
	} else {
		if dl, err = NewDeadLetter(s.e.ctx(), client, s.dlqURL); err != nil {
			s.violate("consumer %d: NewDeadLetter: %v", gen, err)
			return
		}
	}
	logger := slog.New(slog.DiscardHandler)
	if os.Getenv("CUSTODY_SQS_SOAK_LOG") != "" {
		logger = testlog.New(s.t).With("consumer", gen)
	}
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return s.handle(ctx, gen, m)
	}), s.cfg.Options(soakSink{dl, s}, s.cfg.shutdown, logger)...)
	if err != nil {
		s.violate("consumer %d: consumer.New: %v", gen, err)
		src.Close()
		return
	}
	s.log.Drive(gen, c, func(cancel context.CancelFunc) {
		if life == 0 {
			s.waitEmpty()
		} else {
			time.Sleep(life)
			if crash {
				s.mu.Lock()
				if s.crashed == nil {
					s.crashed = make(map[int]bool)
				}
				s.crashed[gen] = true
				s.mu.Unlock()
				tr.dead.Store(true)
			}
		}
		cancel()
	}, func(err error) bool {
		// A crashed consumer's calls all fail; a graceful stop may report a
		// release the faults made fail.
		return crash || strings.Contains(err.Error(), injected)
	})
}

// waitEmpty waits until the queue holds no message, visible, in flight or
// delayed, and flags it when that takes more than a few minutes.
func (s *sqsSoak) waitEmpty() {
	deadline := time.Now().Add(3 * time.Minute)
	for {
		out, err := s.e.client.GetQueueAttributes(s.e.ctx(), &sqs.GetQueueAttributesInput{QueueUrl: aws.String(s.url), AttributeNames: []types.QueueAttributeName{"All"}})
		if err != nil {
			s.violate("GetQueueAttributes: %v", err)
			return
		}
		n := 0
		for _, a := range []string{"ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible", "ApproximateNumberOfMessagesDelayed"} {
			c, _ := strconv.Atoi(out.Attributes[a])
			n += c
		}
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			s.mu.Lock()
			var missing []int
			for seq := range s.seqToID {
				if !s.succeeded[strconv.Itoa(seq)] {
					missing = append(missing, seq)
				}
			}
			s.mu.Unlock()
			s.violate("the queue never emptied: %d messages left (%v); not handled successfully: %v", n, out.Attributes, missing)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// readDeadLetters empties the dead-letter queue and returns the sequence
// numbers of the messages it held, checking the sink's diagnostics.
func (s *sqsSoak) readDeadLetters() map[int]bool {
	dead := make(map[int]bool)
	for empty := 0; empty < 3; {
		got := s.e.drain(s.dlqURL, 0)
		if len(got) == 0 {
			empty++
			time.Sleep(50 * time.Millisecond)
			continue
		}
		empty = 0
		for _, m := range got {
			seq, err := strconv.Atoi(aws.ToString(m.Body))
			if err != nil {
				s.t.Errorf("dead-letter queue holds a message with body %q", aws.ToString(m.Body))
				continue
			}
			dead[seq] = true
			if s.cfg.redrive {
				continue // moved by SQS as it was
			}
			diag, err := DecodeDiagnostics(m.MessageAttributes, DefaultDiagnosticsAttribute)
			if err != nil {
				s.t.Errorf("dead-letter copy of message %d: %v", seq, err)
				continue
			}
			if diag[adapters.HeaderError] == "" || diag[adapters.HeaderAttempts] == "" {
				s.t.Errorf("dead-letter copy of message %d lacks its diagnostics: %v", seq, diag)
			}
			if id := diag[adapters.HeaderOriginalID]; id != s.seqToID[seq] {
				s.t.Errorf("dead-letter copy of message %d names original %q, want %q", seq, id, s.seqToID[seq])
			}
		}
	}
	return dead
}

// handle is every consumer's handler: it checks for overlaps, then behaves
// as chosen at random.
func (s *sqsSoak) handle(ctx context.Context, gen int, m *consumer.Message) error {
	seq, err := strconv.Atoi(string(m.Body))
	if err != nil || seq < 0 || seq >= s.cfg.messages {
		s.violate("unexpected body %q", m.Body)
		return consumer.Permanent(fmt.Errorf("bad body %q", m.Body))
	}
	native, _ := Message(m)
	s.mu.Lock()
	s.seqToID[seq] = m.ID
	r := s.rng.Float64()
	// Some outlive a third of the visibility timeout, when the heartbeat
	// renews it, and some the whole of it.
	slow := time.Duration(float64(s.cfg.visibility) * (0.2 + 1.6*s.rng.Float64()))
	s.mu.Unlock()
	if r >= 0.30 {
		slow = 0
	}
	// The same key must not overlap where the key orders (a FIFO group, or
	// OrderByKey) within one consumer, nor a FIFO group's across consumers
	// where the emulator blocks groups as SQS does (see orderCheck).
	end := s.log.Start(&soaktest.Call{Gen: gen, ID: m.ID, Key: m.Key, Ctx: ctx}, func(o *soaktest.Call) bool {
		return o.Key == m.Key && (s.cfg.fifo || s.cfg.ByKey) && (o.Gen == gen || s.cfg.orderCheck)
	})
	defer end()
	err = soaktest.Behave(ctx, seq, m.Attempt, r, slow, 3*time.Millisecond, func(cause error) {
		s.mu.Lock()
		crashed := s.crashed[gen]
		s.mu.Unlock()
		if errors.Is(cause, adapters.ErrLeaseLost) && s.cfg.visibilityFail == 0 && s.cfg.visibilityDelay == 0 && !crashed {
			// No visibility change failed or was held up: the keeper
			// should have kept the lease for as long as the handler ran.
			s.violate("message %s (body %d): lease lost in consumer %d although no renewal failed: %v", m.ID, seq, gen, cause)
		}
	})
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.succeeded[strconv.Itoa(seq)] = true
	s.ackable[aws.ToString(native.ReceiptHandle)] = true
	s.mu.Unlock()
	s.log.Settled(m.ID, m.Key, seq)
	return nil
}

// soakSink notes what it dead-letters. It settles the original when the sink
// it wraps does (the redrive policy's release): the runtime must then never
// delete it, so its receipt handle is not ackable.
type soakSink struct {
	adapters.DeadLetter
	s *sqsSoak
}

func (dl soakSink) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	err := dl.DeadLetter.Send(ctx, d, f)
	if err == nil {
		seq, _ := strconv.Atoi(string(d.Body))
		if !dl.SettlesOriginal(d) {
			dl.s.mu.Lock()
			dl.s.ackable[receipt(d)] = true
			dl.s.mu.Unlock()
		}
		dl.s.log.Settled(d.ID, d.Key, seq)
	}
	return err
}

func (dl soakSink) SettlesOriginal(d *adapters.Delivery) bool {
	so, ok := dl.DeadLetter.(adapters.OriginalSettler)
	return ok && so.SettlesOriginal(d)
}

// injected is in the text of every fault the soak injects.
const injected = "soak: injected"

// soakTransport carries one consumer's requests to the emulator, injecting
// the round's faults, and checks every delete against the handlers'
// outcomes. Once dead (a crash) it fails every request unsent.
type soakTransport struct {
	s    *sqsSoak
	base http.RoundTripper
	gen  int
	dead atomic.Bool
}

func (tr *soakTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if tr.dead.Load() {
		return nil, errors.New(injected + " crash: the network is gone")
	}
	op := r.Header.Get("X-Amz-Target")
	op = op[strings.LastIndexByte(op, '.')+1:]
	s := tr.s
	var fail, delay float64
	switch op {
	case "DeleteMessageBatch":
		s.deleteCalls.Add(1)
		body, err := io.ReadAll(r.Body)
		r.Body.Close()
		if err != nil {
			return nil, err
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		s.checkDeletes(body)
		fail, delay = s.cfg.deleteFail, s.cfg.deleteDelay
	case "ChangeMessageVisibilityBatch":
		s.visibilityCalls.Add(1)
		fail, delay = s.cfg.visibilityFail, s.cfg.visibilityDelay
	case "ReceiveMessage":
		s.receiveCalls.Add(1)
		fail = s.cfg.receiveFail
	case "SendMessage":
		fail = s.cfg.sendFail
	}
	if s.float() < delay {
		s.faults.Add(1)
		hold := time.Duration(s.float() * float64(s.cfg.visibility) / 2)
		t := time.NewTimer(hold)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			return nil, r.Context().Err()
		}
	}
	lose := s.float() < fail
	if lose {
		s.faults.Add(1)
		if s.float() < 0.5 {
			return nil, errors.New(injected + " failure: connection refused")
		}
	}
	resp, err := tr.base.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	if op == "ReceiveMessage" {
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return nil, err
		}
		resp.Body = io.NopCloser(bytes.NewReader(body))
		s.checkReceived(tr.gen, body)
	}
	if lose {
		// SQS acted on the request; its answer never arrives.
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return nil, errors.New(injected + " lost answer: connection reset by peer")
	}
	return resp, nil
}

// checkReceived has the log check, for every message of a ReceiveMessage
// answer, that no call of it still runs with a live context.
func (s *sqsSoak) checkReceived(gen int, body []byte) {
	var out struct {
		Messages []struct{ MessageId string }
	}
	if len(body) == 0 {
		return // the emulator answers an empty receive with no body
	}
	if err := json.Unmarshal(body, &out); err != nil {
		s.violate("ReceiveMessage answer the soak cannot read: %v: %.200s", err, body)
		return
	}
	for _, m := range out.Messages {
		s.log.Received(m.MessageId, gen)
	}
}

// checkDeletes flags every receipt handle of a DeleteMessageBatch request
// whose delivery no handler succeeded for and that was not dead-lettered.
func (s *sqsSoak) checkDeletes(body []byte) {
	var in struct {
		Entries []struct{ ReceiptHandle string }
	}
	if err := json.Unmarshal(body, &in); err != nil {
		s.violate("DeleteMessageBatch request the soak cannot read: %v", err)
		return
	}
	for _, e := range in.Entries {
		s.mu.Lock()
		ok := s.ackable[e.ReceiptHandle]
		s.mu.Unlock()
		if !ok {
			s.violate("a delivery (receipt %.40s...) was deleted before a handler succeeded for it or it was dead-lettered", e.ReceiptHandle)
		}
	}
}
