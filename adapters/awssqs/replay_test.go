package awssqs

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// replaySetup is a queue and its dead-letter queue, of one type, on the
// emulator.
type replaySetup struct {
	*env
	t           *testing.T
	fifo        bool
	url, dlqURL string
	name        string // the queue's name
}

func newReplaySetup(t *testing.T, fifo bool) *replaySetup {
	t.Helper()
	e := newEnv(t)
	url, _ := e.queue(fifo, 30*time.Second, nil)
	dlqURL, _ := e.queue(fifo, 30*time.Second, nil)
	name, _ := queueName(url)
	return &replaySetup{env: e, t: t, fifo: fifo, url: url, dlqURL: dlqURL, name: name}
}

// group is the FIFO group of a body: "g" and its last character.
func (s *replaySetup) group(body string) string {
	if !s.fifo {
		return ""
	}
	return "g" + body[len(body)-1:]
}

// deadLetter sends the bodies to the queue, each with a "tenant"
// attribute, and runs a consumer that fails them all permanently, with a
// DeadLetter sink, until every one is in the dead-letter queue.
func (s *replaySetup) deadLetter(bodies ...string) {
	s.t.Helper()
	for _, b := range bodies {
		s.send(s.url, b, s.group(b), map[string]string{"tenant": "acme"})
	}
	src, err := New(s.ctx(), s.client, s.url, testOptions()...)
	if err != nil {
		s.t.Fatal(err)
	}
	dlq, err := NewDeadLetter(s.ctx(), s.client, s.dlqURL)
	if err != nil {
		s.t.Fatal(err)
	}
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return consumer.Permanent(fmt.Errorf("cannot parse %s", m.Body))
	})
	want := s.stored(s.dlqURL) + len(bodies)
	runUntil(s.t, src, h, "the dead letters", func() bool {
		v, f := s.counts(s.url)
		return v+f == 0 && s.stored(s.dlqURL) == want
	}, consumer.WithConcurrency(4), consumer.WithDeadLetter(dlq))
	// The emulator goes on serving a receive the stopped consumer cut, for
	// the rest of its short poll: a message sent meanwhile would be taken,
	// and stay invisible for the queue's visibility timeout.
	time.Sleep(250 * time.Millisecond)
}

// handled runs a consumer on the queue that handles every message, until
// it has handled n, and returns them.
func (s *replaySetup) handled(n int) []types.Message {
	s.t.Helper()
	src, err := New(s.ctx(), s.client, s.url, testOptions()...)
	if err != nil {
		s.t.Fatal(err)
	}
	var (
		mu  sync.Mutex
		got []types.Message
	)
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		msg, _ := Message(m)
		mu.Lock()
		got = append(got, msg)
		mu.Unlock()
		return nil
	})
	runUntil(s.t, src, h, fmt.Sprintf("%d messages handled", n), func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(got) >= n
	})
	// Anything more would be a duplicate: give it a moment to show.
	time.Sleep(100 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	return got
}

// drainAll receives and deletes every message of url until a receive
// finds none.
func (s *replaySetup) drainAll(url string) []types.Message {
	s.t.Helper()
	var all []types.Message
	for {
		got := s.drain(url, 0)
		if len(got) == 0 {
			return all
		}
		all = append(all, got...)
	}
}

func (s *replaySetup) newReplay(client ReplayClient, opts ...ReplayOption) *Replay {
	s.t.Helper()
	r, err := NewReplay(s.ctx(), client, s.dlqURL, append([]ReplayOption{WithReplayWaitTime(0)}, opts...)...)
	if err != nil {
		s.t.Fatal(err)
	}
	return r
}

func bodies(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s%d", prefix, i)
	}
	return out
}

// TestReplayListsAndMovesBack: List shows the runtime's dead letters with
// their diagnostics and gives them back; Replay copies each to its queue as
// it was sent (attributes and FIFO group kept, diagnostics stripped, the
// dead letter's id in custody-replay-of) and deletes it; the consumer then
// handles each once.
func TestReplayListsAndMovesBack(t *testing.T) {
	t.Parallel()
	for _, fifo := range []bool{false, true} {
		t.Run(map[bool]string{false: "standard", true: "fifo"}[fifo], func(t *testing.T) {
			t.Parallel()
			s := newReplaySetup(t, fifo)
			sent := bodies("bad", 3)
			s.deadLetter(sent...)
			r := s.newReplay(s.client)

			recs, err := r.List(s.ctx(), 100)
			if err != nil {
				t.Fatal(err)
			}
			if len(recs) != 3 {
				t.Fatalf("List returned %d records, want 3", len(recs))
			}
			ids := map[string]string{} // body -> dead letter id
			for _, rec := range recs {
				body := string(rec.Body)
				ids[body] = rec.ID
				if rec.OriginalQueue != s.name || rec.Consumer != "sqs:"+s.name || !rec.Permanent || rec.Attempts != 1 ||
					!strings.HasSuffix(rec.Error, "cannot parse "+body) || rec.LastFailure.IsZero() || rec.OriginalID == "" {
					t.Errorf("record %+v", rec)
				}
				if rec.Headers["tenant"] != "acme" || len(rec.Headers) != 1 {
					t.Errorf("record %s headers %v, want the original's only", body, rec.Headers)
				}
				if rec.Key != s.group(body) {
					t.Errorf("record %s key %q, want %q", body, rec.Key, s.group(body))
				}
				if rec.Diagnostics[adapters.HeaderError] != rec.Error {
					t.Errorf("record %s diagnostics %v", body, rec.Diagnostics)
				}
			}
			if len(ids) != 3 {
				t.Fatalf("List returned %v", recs)
			}
			// List gave them back: visible again at once.
			waitFor(t, "the dead letters visible again", func() bool { v, _ := s.counts(s.dlqURL); return v == 3 })

			res, err := r.Replay(s.ctx(), adapters.ReplayOptions{Rate: 100})
			if err != nil {
				t.Fatal(err)
			}
			if res != (adapters.ReplayResult{Replayed: 3}) {
				t.Errorf("Replay: %+v, want 3 replayed", res)
			}
			if n := s.stored(s.dlqURL); n != 0 {
				t.Errorf("dead-letter queue holds %d messages after the replay", n)
			}
			got := s.handled(3)
			if len(got) != 3 {
				t.Fatalf("handled %d messages after the replay, want 3", len(got))
			}
			for _, m := range got {
				body := aws.ToString(m.Body)
				if m.MessageAttributes["tenant"].StringValue == nil || *m.MessageAttributes["tenant"].StringValue != "acme" {
					t.Errorf("%s lost its attribute: %v", body, m.MessageAttributes)
				}
				if v := aws.ToString(m.MessageAttributes[adapters.HeaderReplayOf].StringValue); v != ids[body] {
					t.Errorf("%s: %s = %q, want its dead letter's id %q", body, adapters.HeaderReplayOf, v, ids[body])
				}
				if len(m.MessageAttributes) != 2 {
					t.Errorf("%s carries %v, want tenant and %s only (no diagnostics)", body, m.MessageAttributes, adapters.HeaderReplayOf)
				}
				if fifo {
					if g := m.Attributes["MessageGroupId"]; g != s.group(body) {
						t.Errorf("%s replayed in group %q, want %q", body, g, s.group(body))
					}
					if d := m.Attributes["MessageDeduplicationId"]; d != replayDeduplicationID(ids[body]) {
						t.Errorf("%s deduplication id %q, want one derived from its dead letter's id", body, d)
					}
				}
			}
			if res, err := r.Replay(s.ctx(), adapters.ReplayOptions{Rate: 100}); err != nil || res != (adapters.ReplayResult{}) {
				t.Errorf("second Replay: %+v, %v; want nothing to do", res, err)
			}
		})
	}
}

// crashingClient is a client through which a replay's process dies: the
// request number crashAt that changes something (a SendMessage or a
// DeleteMessage) takes effect in SQS, and then its answer and every later
// request are lost, as when the process dies while the answer is on its way
// (nothing is given back).
type crashingClient struct {
	ReplayClient
	crashAt int32
	changes atomic.Int32
	dead    atomic.Bool
}

var errCrashed = errors.New("the replay's process is gone")

func (c *crashingClient) change() (last bool, err error) {
	if c.dead.Load() {
		return false, errCrashed
	}
	return c.changes.Add(1) == c.crashAt, nil
}

func (c *crashingClient) DeleteMessage(ctx context.Context, in *sqs.DeleteMessageInput, optFns ...func(*sqs.Options)) (*sqs.DeleteMessageOutput, error) {
	last, err := c.change()
	if err != nil {
		return nil, err
	}
	out, err := c.ReplayClient.DeleteMessage(ctx, in, optFns...)
	if last {
		c.dead.Store(true)
		return nil, errCrashed
	}
	return out, err
}

func (c *crashingClient) SendMessage(ctx context.Context, in *sqs.SendMessageInput, optFns ...func(*sqs.Options)) (*sqs.SendMessageOutput, error) {
	last, err := c.change()
	if err != nil {
		return nil, err
	}
	out, err := c.ReplayClient.SendMessage(ctx, in, optFns...)
	if last {
		c.dead.Store(true)
		return nil, errCrashed
	}
	return out, err
}

func (c *crashingClient) ReceiveMessage(ctx context.Context, in *sqs.ReceiveMessageInput, optFns ...func(*sqs.Options)) (*sqs.ReceiveMessageOutput, error) {
	if c.dead.Load() {
		return nil, errCrashed
	}
	return c.ReplayClient.ReceiveMessage(ctx, in, optFns...)
}

func (c *crashingClient) ChangeMessageVisibilityBatch(ctx context.Context, in *sqs.ChangeMessageVisibilityBatchInput, optFns ...func(*sqs.Options)) (*sqs.ChangeMessageVisibilityBatchOutput, error) {
	if c.dead.Load() {
		return nil, errCrashed
	}
	return c.ReplayClient.ChangeMessageVisibilityBatch(ctx, in, optFns...)
}

func (c *crashingClient) GetQueueUrl(ctx context.Context, in *sqs.GetQueueUrlInput, optFns ...func(*sqs.Options)) (*sqs.GetQueueUrlOutput, error) {
	if c.dead.Load() {
		return nil, errCrashed
	}
	return c.ReplayClient.GetQueueUrl(ctx, in, optFns...)
}

// TestReplayCrashInTheMiddle: a replay whose process dies while it moves
// the third of six dead letters, and a second replay run after it, move
// every dead letter back: none is lost, wherever the crash falls. A crash
// after SQS stored the third copy and before the dead letter was deleted
// sends that one back twice into a standard queue (SQS cannot tell; the
// twins carry the same custody-replay-of, for a consumer to drop), and
// once into a FIFO queue, whose deduplication drops the second copy. A
// crash after the deletion duplicates nothing.
func TestReplayCrashInTheMiddle(t *testing.T) {
	t.Parallel()
	for _, fifo := range []bool{false, true} {
		for _, crash := range []struct {
			name    string
			at      int32 // the request that changes something, counted from 1
			standby int   // duplicates a standard queue gets
		}{{"after-the-copy", 5, 1}, {"after-the-delete", 6, 0}} {
			t.Run(map[bool]string{false: "standard", true: "fifo"}[fifo]+"/"+crash.name, func(t *testing.T) {
				t.Parallel()
				s := newReplaySetup(t, fifo)
				sent := bodies("crash", 6)
				s.deadLetter(sent...)

				crashing := &crashingClient{ReplayClient: s.client, crashAt: crash.at}
				res, err := s.newReplay(crashing, WithReplayHold(time.Second)).Replay(s.ctx(), adapters.ReplayOptions{Rate: 100})
				if !errors.Is(err, errCrashed) || res.Replayed != 2 {
					t.Fatalf("the crashing replay: %+v, %v; want 2 replayed and the crash", res, err)
				}
				// A new process, once the dead letters the dead one held
				// are back in sight.
				waitFor(t, "the held dead letters back in sight", func() bool { _, f := s.counts(s.dlqURL); return f == 0 })
				res, err = s.newReplay(s.client, WithReplayHold(time.Second)).Replay(s.ctx(), adapters.ReplayOptions{Rate: 100})
				if err != nil {
					t.Fatalf("the second replay: %+v, %v", res, err)
				}
				left := 4 // the third dead letter, if not deleted, and three untouched
				if crash.standby == 0 {
					left = 3
				}
				if res.Replayed != left {
					t.Errorf("the second replay moved %d dead letters, want %d", res.Replayed, left)
				}
				if n := s.stored(s.dlqURL); n != 0 {
					t.Errorf("dead-letter queue holds %d messages after both replays", n)
				}

				copies := map[string]int{}
				replayOf := map[string]map[string]bool{}
				for _, m := range s.drainAll(s.url) {
					body := aws.ToString(m.Body)
					copies[body]++
					if replayOf[body] == nil {
						replayOf[body] = map[string]bool{}
					}
					replayOf[body][aws.ToString(m.MessageAttributes[adapters.HeaderReplayOf].StringValue)] = true
				}
				dup := 0
				for _, b := range sent {
					switch n := copies[b]; {
					case n == 0:
						t.Errorf("%s lost: not back in its queue", b)
					case n > 1:
						dup += n - 1
						if len(replayOf[b]) != 1 {
							t.Errorf("the copies of %s carry different %s: %v", b, adapters.HeaderReplayOf, replayOf[b])
						}
					}
				}
				want := crash.standby
				if fifo {
					want = 0
				}
				if dup != want {
					t.Errorf("%d duplicate copies (%v), want %d", dup, copies, want)
				}
			})
		}
	}
}

// deleteFailingReplayClient fails DeleteMessage number failAt without deleting.
type deleteFailingReplayClient struct {
	ReplayClient
	failAt  int32
	deletes atomic.Int32
}

var errDeleteFailed = errors.New("delete failed")

func (c *deleteFailingReplayClient) DeleteMessage(ctx context.Context, in *sqs.DeleteMessageInput, optFns ...func(*sqs.Options)) (*sqs.DeleteMessageOutput, error) {
	if c.deletes.Add(1) == c.failAt {
		return nil, errDeleteFailed
	}
	return c.ReplayClient.DeleteMessage(ctx, in, optFns...)
}

// TestReplayRemembersACopyWhoseDeleteFailed: when a delete fails and the
// process lives on, running the same Replay again deletes that dead letter
// without a second copy, even into a standard queue; and the first run gave
// it back at once, so the second finds it without waiting for the hold.
func TestReplayRemembersACopyWhoseDeleteFailed(t *testing.T) {
	t.Parallel()
	s := newReplaySetup(t, false)
	sent := bodies("again", 4)
	s.deadLetter(sent...)
	r := s.newReplay(&deleteFailingReplayClient{ReplayClient: s.client, failAt: 2}, WithReplayHold(time.Hour))
	res, err := r.Replay(s.ctx(), adapters.ReplayOptions{Rate: 100})
	if !errors.Is(err, errDeleteFailed) || res.Replayed != 1 {
		t.Fatalf("first run: %+v, %v; want 1 replayed, then the failed delete", res, err)
	}
	waitFor(t, "the dead letters given back", func() bool { v, f := s.counts(s.dlqURL); return v == 3 && f == 0 })
	res, err = r.Replay(s.ctx(), adapters.ReplayOptions{Rate: 100})
	if err != nil || res != (adapters.ReplayResult{Replayed: 2, Skipped: 1}) {
		t.Fatalf("second run: %+v, %v; want 2 replayed and the copied one deleted (skipped)", res, err)
	}
	if n := s.stored(s.dlqURL); n != 0 {
		t.Errorf("dead-letter queue holds %d messages", n)
	}
	copies := map[string]int{}
	for _, m := range s.drainAll(s.url) {
		copies[aws.ToString(m.Body)]++
	}
	for _, b := range sent {
		if copies[b] != 1 {
			t.Errorf("%s went back %d times, want once", b, copies[b])
		}
	}
}

// TestReplaySelectMaxKeepAndRate: Select leaves dead letters where they are
// (and makes them visible again at once, not after the hold), Max bounds
// the copies, KeepDiagnostics packs the diagnostics into the copy, and Rate
// spaces the copies out.
func TestReplaySelectMaxKeepAndRate(t *testing.T) {
	t.Parallel()
	s := newReplaySetup(t, false)
	s.deadLetter(append(bodies("keep", 5), "skipme")...)
	// A hold longer than the test: what a run leaves is visible again only
	// if the run gave it back.
	r := s.newReplay(s.client, WithReplayHold(time.Hour))
	notSkipme := func(rec adapters.DeadLetterRecord) bool { return !strings.Contains(rec.Error, "skipme") }
	start := time.Now()
	res, err := r.Replay(s.ctx(), adapters.ReplayOptions{Rate: 10, Max: 4, KeepDiagnostics: true, Select: notSkipme})
	if err != nil || res.Replayed != 4 {
		t.Fatalf("Replay: %+v, %v; want 4 replayed", res, err)
	}
	if took := time.Since(start); took < 300*time.Millisecond {
		t.Errorf("4 copies at 10 a second took %v, want at least 300ms", took)
	}
	waitFor(t, "the dead letters left given back", func() bool { v, f := s.counts(s.dlqURL); return v == 2 && f == 0 })
	back := s.drainAll(s.url)
	if len(back) != 4 {
		t.Fatalf("%d copies, want 4", len(back))
	}
	for _, m := range back {
		js := aws.ToString(m.MessageAttributes[adapters.HeaderReplayDiagnostics].StringValue)
		var diag map[string]string
		if err := json.Unmarshal([]byte(js), &diag); err != nil {
			t.Fatalf("%s: %q: %v", adapters.HeaderReplayDiagnostics, js, err)
		}
		if !strings.HasSuffix(diag[adapters.HeaderError], "cannot parse "+aws.ToString(m.Body)) || diag[adapters.HeaderOriginalQueue] != s.name {
			t.Errorf("kept diagnostics %v", diag)
		}
		if _, ok := m.MessageAttributes[DefaultDiagnosticsAttribute]; ok {
			t.Errorf("the copy carries the %s attribute", DefaultDiagnosticsAttribute)
		}
	}
	res, err = r.Replay(s.ctx(), adapters.ReplayOptions{Rate: 100, Select: notSkipme})
	if err != nil || res != (adapters.ReplayResult{Replayed: 1, Skipped: 1}) {
		t.Fatalf("second Replay: %+v, %v; want 1 replayed and skipme skipped", res, err)
	}
	waitFor(t, "skipme given back", func() bool { v, f := s.counts(s.dlqURL); return v == 1 && f == 0 })
}

// TestReplayOfSQSRedrive: a message SQS's own redrive policy moved (no
// diagnostics, its source in DeadLetterQueueSourceArn) goes back to that
// queue.
func TestReplayOfSQSRedrive(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dlqURL, arn := e.queue(false, 30*time.Second, nil)
	url, _ := e.queue(false, 1*time.Second, map[string]string{"RedrivePolicy": redrivePolicyJSON(arn, 1)})
	name, _ := queueName(url)
	e.send(url, "moved", "", map[string]string{"tenant": "acme"})
	if got := e.drainNoDelete(url); got != 1 {
		t.Fatalf("received %d messages, want 1", got)
	}
	// Its visibility runs out with its receive count at the maximum: the
	// emulator moves it then (SQS, at the next receive).
	waitFor(t, "the redrive", func() bool { e.drainNoDelete(url); return e.stored(dlqURL) == 1 })
	r, err := NewReplay(e.ctx(), e.client, dlqURL, WithReplayWaitTime(0))
	if err != nil {
		t.Fatal(err)
	}
	recs, err := r.List(e.ctx(), 10)
	if err != nil || len(recs) != 1 {
		t.Fatalf("List: %+v, %v", recs, err)
	}
	if rec := recs[0]; rec.OriginalQueue != name || rec.Headers["tenant"] != "acme" || rec.Error != "" {
		t.Errorf("record %+v", rec)
	}
	waitFor(t, "the dead letter visible again", func() bool { v, _ := e.counts(dlqURL); return v == 1 })
	res, err := r.Replay(e.ctx(), adapters.ReplayOptions{Rate: 100})
	if err != nil || res.Replayed != 1 {
		t.Fatalf("Replay: %+v, %v", res, err)
	}
	back := e.drain(url, 0)
	if len(back) != 1 || aws.ToString(back[0].Body) != "moved" || aws.ToString(back[0].MessageAttributes[adapters.HeaderReplayOf].StringValue) != recs[0].ID {
		t.Fatalf("the queue holds %+v", back)
	}
}

// drainNoDelete receives what is visible on url, without deleting it, and
// returns how many it got.
func (e *env) drainNoDelete(url string) int {
	e.t.Helper()
	out, err := e.client.ReceiveMessage(e.ctx(), &sqs.ReceiveMessageInput{QueueUrl: aws.String(url), MaxNumberOfMessages: 10})
	if err != nil {
		e.t.Fatalf("ReceiveMessage: %v", err)
	}
	return len(out.Messages)
}

// TestReplayRefusals: bad options fail at construction; dead letters that
// cannot go back (naming no queue, a queue that is gone, too many
// attributes for the copy) stop the run before anything is sent, and stay.
func TestReplayRefusals(t *testing.T) {
	t.Parallel()
	s := newReplaySetup(t, false)
	for _, opts := range [][]ReplayOption{{WithReplayHold(0)}, {WithReplayHold(1500 * time.Millisecond)}, {WithReplayWaitTime(21 * time.Second)}, {WithReplayDiagnosticsAttribute("AWS.x")}} {
		if _, err := NewReplay(s.ctx(), s.client, s.dlqURL, opts...); err == nil || !strings.Contains(err.Error(), "awssqs.WithReplay") {
			t.Errorf("NewReplay with a bad option: %v", err)
		}
	}
	if _, err := NewReplay(s.ctx(), s.client, s.dlqURL+"-missing"); err == nil {
		t.Error("NewReplay of a missing queue succeeded")
	}
	if _, err := NewReplay(s.ctx(), nil, s.dlqURL); err == nil {
		t.Error("NewReplay with a nil client succeeded")
	}
	r := s.newReplay(s.client)
	if _, err := r.List(s.ctx(), 0); err == nil {
		t.Error("List(0) succeeded")
	}
	for _, o := range []adapters.ReplayOptions{{Rate: -1}, {Max: -1}} {
		if _, err := r.Replay(s.ctx(), o); err == nil {
			t.Errorf("Replay(%+v) succeeded", o)
		}
	}

	only := func(body string) func(adapters.DeadLetterRecord) bool {
		return func(rec adapters.DeadLetterRecord) bool { return string(rec.Body) == body }
	}
	// Not a dead letter: no diagnostics, no source ARN.
	s.send(s.dlqURL, "stray", "", nil)
	// A dead letter of a queue that is gone.
	gone, _ := s.queue(false, 30*time.Second, nil)
	goneName, _ := queueName(gone)
	s.sendAttributes(s.dlqURL, "orphan", "", map[string]types.MessageAttributeValue{
		DefaultDiagnosticsAttribute: {DataType: aws.String("String"), StringValue: aws.String(fmt.Sprintf(`{%q:%q}`, adapters.HeaderOriginalQueue, goneName))},
	})
	if _, err := s.client.DeleteQueue(s.ctx(), &sqs.DeleteQueueInput{QueueUrl: aws.String(gone)}); err != nil {
		t.Fatal(err)
	}
	// An original with SQS's ten attributes: one of them travelled in the
	// diagnostics, and the copy would need eleven with custody-replay-of.
	ten := map[string]string{}
	for i := range 10 {
		ten[fmt.Sprintf("a%d", i)] = "v"
	}
	s.send(s.url, "crowded", "", ten)
	src, _ := New(s.ctx(), s.client, s.url, testOptions()...)
	dlq, _ := NewDeadLetter(s.ctx(), s.client, s.dlqURL)
	runUntil(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return consumer.Permanent(errors.New("no"))
	}), "the crowded dead letter", func() bool { v, f := s.counts(s.url); return v+f == 0 }, consumer.WithDeadLetter(dlq))

	s.counter.Reset()
	for body, want := range map[string]string{"stray": "names no original queue", "orphan": goneName, "crowded": "11 message attributes"} {
		res, err := r.Replay(s.ctx(), adapters.ReplayOptions{Rate: 100, Select: only(body)})
		if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "Select") || res.Replayed != 0 {
			t.Errorf("Replay of %s: %+v, %v; want an error saying %q and how to leave it out", body, res, err, want)
		}
	}
	if n := s.counter.Op("SendMessage"); n != 0 {
		t.Errorf("%d copies sent for dead letters that cannot go back", n)
	}
	waitFor(t, "the three dead letters in sight", func() bool { v, f := s.counts(s.dlqURL); return v == 3 && f == 0 })
}

// TestReplayRequestsPerDeadLetter: what a replay costs in SQS requests,
// which SQS bills. Moving a dead letter is a copy and a delete, plus a
// tenth of a receive; a List is a tenth of a receive and a tenth of a
// visibility change per dead letter.
func TestReplayRequestsPerDeadLetter(t *testing.T) {
	t.Parallel()
	s := newReplaySetup(t, false)
	const n = 30
	diag := fmt.Sprintf(`{%q:%q,%q:"boom"}`, adapters.HeaderOriginalQueue, s.name, adapters.HeaderError)
	for i := range n {
		s.sendAttributes(s.dlqURL, fmt.Sprint(i), "", map[string]types.MessageAttributeValue{
			DefaultDiagnosticsAttribute: {DataType: aws.String("String"), StringValue: aws.String(diag)},
		})
	}
	waitFor(t, "the dead letters in sight", func() bool { v, _ := s.counts(s.dlqURL); return v == n })
	r := s.newReplay(s.client)
	s.counter.Reset()
	if recs, err := r.List(s.ctx(), 100); err != nil || len(recs) != n {
		t.Fatalf("List: %d records, %v", len(recs), err)
	}
	// Three full receives, one that finds nothing new, three releases.
	if got, want := s.counter.Total(), int64(n/10+1+n/10); got != want {
		t.Errorf("List of %d dead letters made %d requests (%d receives, %d visibility changes), want %d",
			n, got, s.counter.Op("ReceiveMessage"), s.counter.Op("ChangeMessageVisibilityBatch"), want)
	}
	waitFor(t, "the dead letters back in sight", func() bool { v, _ := s.counts(s.dlqURL); return v == n })
	s.counter.Reset()
	if res, err := r.Replay(s.ctx(), adapters.ReplayOptions{Rate: 1000}); err != nil || res.Replayed != n {
		t.Fatalf("Replay: %+v, %v", res, err)
	}
	// A copy and a delete each, three full receives and an empty one, and
	// one GetQueueUrl for the queue they go back to.
	want := int64(2*n + n/10 + 1 + 1)
	if got := s.counter.Total(); got != want {
		t.Errorf("Replay of %d dead letters made %d requests (%.2f each), want %d", n, got, float64(got)/n, want)
	}
	t.Logf("requests per dead letter: List %.2f, Replay %.2f", float64(n/10+1+n/10)/n, float64(want)/n)
}

// receiveCounting counts how often each message id was received.
type receiveCounting struct {
	ReplayClient
	mu       sync.Mutex
	received map[string]int
}

func (c *receiveCounting) ReceiveMessage(ctx context.Context, in *sqs.ReceiveMessageInput, optFns ...func(*sqs.Options)) (*sqs.ReceiveMessageOutput, error) {
	out, err := c.ReplayClient.ReceiveMessage(ctx, in, optFns...)
	if err == nil {
		c.mu.Lock()
		if c.received == nil {
			c.received = map[string]int{}
		}
		for _, m := range out.Messages {
			c.received[aws.ToString(m.MessageId)]++
		}
		c.mu.Unlock()
	}
	return out, err
}

// TestReplaySlowRateKeepsItsHold: at a rate too slow to copy ten dead
// letters within the hold, a run receives fewer at a time, so that it
// copies each while it still holds it: none is received twice (which would
// count against a redrive policy of the dead-letter queue and wait out a
// hold), and all move in one run.
func TestReplaySlowRateKeepsItsHold(t *testing.T) {
	t.Parallel()
	s := newReplaySetup(t, false)
	s.deadLetter(bodies("slow", 6)...)
	c := &receiveCounting{ReplayClient: s.client}
	res, err := s.newReplay(c, WithReplayHold(3*time.Second)).Replay(s.ctx(), adapters.ReplayOptions{Rate: 2})
	if err != nil || res.Replayed != 6 {
		t.Fatalf("Replay at 2 a second with a 3s hold: %+v, %v; want all 6 in one run", res, err)
	}
	for id, n := range c.received {
		if n != 1 {
			t.Errorf("dead letter %s received %d times, want once", id, n)
		}
	}
	copies := map[string]int{}
	for _, m := range s.drainAll(s.url) {
		copies[aws.ToString(m.Body)]++
	}
	for _, b := range bodies("slow", 6) {
		if copies[b] != 1 {
			t.Errorf("%s went back %d times, want once", b, copies[b])
		}
	}
}
