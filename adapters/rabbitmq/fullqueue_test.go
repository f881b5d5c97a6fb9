package rabbitmq

import (
	"context"
	"errors"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testbroker"
)

// offer publishes each body to queue, with a message id equal to the body,
// and returns those the broker confirmed; a full queue with x-overflow
// reject-publish refuses the rest.
func (a *admin) offer(queue string, bodies ...string) []string {
	a.t.Helper()
	var took []string
	for _, b := range bodies {
		dc, err := a.ch.PublishWithDeferredConfirm("", queue, true, false, amqp.Publishing{MessageId: b, Body: []byte(b), DeliveryMode: amqp.Persistent})
		if err != nil {
			a.t.Fatal(err)
		}
		if dc.Wait() {
			took = append(took, b)
		}
	}
	return took
}

// length returns the number of ready messages in queue, and false when it
// does not exist.
func (a *admin) length(queue string) (int, bool) {
	a.t.Helper()
	ch, err := a.conn.Channel()
	if err != nil {
		a.t.Fatal(err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return 0, false
	}
	return q.Messages, true
}

// setPolicy applies a broker policy to the queue named exactly name, until
// the test ends.
func setPolicy(t *testing.T, name, definition string) {
	t.Helper()
	policy := uniqueName(t, "policy")
	out, err := exec.Command("rabbitmqctl", "set_policy", "--apply-to", "queues", policy, "^"+regexpQuote(name)+"$", definition).CombinedOutput()
	if err != nil {
		testbroker.Unavailable(t, "rabbitmqctl (to set a policy)", err)
		t.Fatalf("rabbitmqctl set_policy: %s", out)
	}
	t.Cleanup(func() { _ = exec.Command("rabbitmqctl", "clear_policy", policy).Run() })
}

func regexpQuote(s string) string {
	out := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '.', '+', '*', '?', '(', ')', '[', ']', '{', '}', '|', '^', '$', '\\':
			out = append(out, '\\', c)
		default:
			out = append(out, c)
		}
	}
	return string(out)
}

// receiveAll receives and acks until every body in want was seen, and
// returns the deliveries of want[0].
func receiveAll(t *testing.T, s *Source, want ...string) []*adapters.Delivery {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	missing := map[string]bool{}
	for _, b := range want {
		missing[b] = true
	}
	var first []*adapters.Delivery
	for len(missing) > 0 {
		ds, err := s.Receive(ctx, 10)
		if err != nil {
			t.Fatalf("still missing %v: %v", keys(missing), err)
		}
		for _, d := range ds {
			delete(missing, string(d.Body))
			if string(d.Body) == want[0] {
				first = append(first, d)
			}
		}
		if err := s.Ack(ctx, ds); err != nil {
			t.Fatal(err)
		}
	}
	return first
}

func keys(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// A retry never gives up custody of its message to a queue that may refuse
// it: a classic queue limited to 2 messages with x-overflow reject-publish
// (by argument, or by a policy set after the Source started), prefetch 1; A
// fails and asks for a retry in 500 ms, then the queue fills. Without delay
// queues the runtime waits out the retry in place, holding A: no copy is
// published for the full queue to refuse, and A is handled on its second
// attempt, counted by the runtime, with everything the queue took.
func TestRetryIntoAFullQueueKeepsTheMessage(t *testing.T) {
	limit := amqp.Table{"x-max-length": int64(2), "x-overflow": "reject-publish"}
	for _, by := range []string{"argument", "policy"} {
		t.Run(by, func(t *testing.T) {
			a := newAdmin(t)
			var q string
			if by == "argument" {
				q = a.queue(ClassicQueue, limit)
			} else {
				q = a.queue(ClassicQueue, nil)
			}
			a.publish(q, "A")
			s := openSource(t, q, WithPrefetch(1))
			if by == "policy" {
				setPolicy(t, q, `{"max-length":2,"overflow":"reject-publish"}`)
			}
			var (
				seen     handled
				failed   = make(chan struct{})
				attempts sync.Map
			)
			r := runConsumer(t, s, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				seen.add(m.ID)
				if m.ID == "A" {
					attempts.Store(m.Attempt, true)
					if m.Attempt == 1 {
						close(failed)
						return consumer.RetryAfter(errors.New("not yet"), 500*time.Millisecond)
					}
				}
				return nil
			}), consumer.WithConcurrency(1))
			<-failed
			took := a.offer(q, "B", "C", "D")
			if len(took) < 2 {
				t.Fatalf("the queue took %v of B, C, D; want it full", took)
			}
			waitUntil(t, "A and what the queue took handled", func() bool {
				c := seen.snapshot()
				for _, id := range append([]string{"A"}, took...) {
					if c[id] == 0 {
						return false
					}
				}
				return c["A"] == 2
			})
			r.stop(t)
			if _, ok := attempts.Load(2); !ok {
				t.Fatalf("A was not handled at attempt 2; handled %v", seen.snapshot())
			}
			if st := s.Stats(); st.Delivered != uint64(1+len(took)) || st.Rejects != 0 || st.DelayQueued+st.RetriedAtOnce != 0 {
				t.Fatalf("stats %+v: want A delivered once and retried in place, with no copy and no requeue", st)
			}
			waitUnacked(t, q, 0)
			if n := a.ready(q); n != 0 {
				t.Fatalf("%d messages left in the queue", n)
			}
		})
	}
}

// retryDeadLettersEvery makes the broker's at-least-once dead-lettering
// publish again, every d, a message its target refused (its
// dead_letter_worker_publisher_confirm_timeout, 3 minutes by default), for
// the quorum queues declared until the test ends.
func retryDeadLettersEvery(t *testing.T, d time.Duration) {
	t.Helper()
	const key = "dead_letter_worker_publisher_confirm_timeout"
	out, err := exec.Command("rabbitmqctl", "eval", "application:get_env(rabbit, "+key+").").Output()
	if err != nil {
		testbroker.Unavailable(t, "rabbitmqctl eval (to shorten the broker's dead-letter retry)", err)
	}
	was, ok := strings.CutPrefix(strings.TrimSpace(string(out)), "{ok,")
	was, ok2 := strings.CutSuffix(was, "}")
	if !ok || !ok2 {
		t.Fatalf("rabbitmqctl eval: %s = %q", key, out)
	}
	set := func(v string) error {
		return exec.Command("rabbitmqctl", "eval", "application:set_env(rabbit, "+key+", "+v+").").Run()
	}
	if err := set(strconv.FormatInt(d.Milliseconds(), 10)); err != nil {
		t.Fatalf("rabbitmqctl eval: set %s: %v", key, err)
	}
	t.Cleanup(func() { _ = set(was) })
}

// With delay queues, a retry's copy waits in a quorum queue that
// dead-letters it back at least once: when the copy expires into a full
// queue, the broker keeps it and offers it again until the queue takes it.
func TestRetryThroughDelayQueueIntoAFullQueueComesBack(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, amqp.Table{"x-max-length": int64(2), "x-overflow": "reject-publish"})
	retryDeadLettersEvery(t, time.Second)
	a.publish(q, "A")
	s := openSource(t, q, WithPrefetch(1), WithDelayQueues())
	d := receiveN(t, s, 1)[0]
	if err := s.Nack(context.Background(), adapters.NackAll([]*adapters.Delivery{d}, 500*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.DelayQueued != 1 {
		t.Fatalf("stats %+v: want the retry through a delay queue", st)
	}
	took := a.offer(q, "B", "C", "D")
	if len(took) < 2 {
		t.Fatalf("the queue took %v of B, C, D; want it full", took)
	}
	// The copy expires into the full queue, which refuses it.
	delayQueue := delayQueueName(q, delayStep(500*time.Millisecond))
	waitUntil(t, "the copy to expire", func() bool { n, _ := a.length(delayQueue); return n == 0 })
	back := receiveAll(t, s, append([]string{"A"}, took...)...)
	if back[0].Attempt != 2 || !strings.Contains(back[0].Headers["x-death"], delayQueue) {
		t.Fatalf("A came back with attempt %d and x-death %q; want attempt 2, through %s", back[0].Attempt, back[0].Headers["x-death"], delayQueue)
	}
	waitUnacked(t, q, 0)
}
