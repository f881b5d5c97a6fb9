package rabbitmq

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/testkit/testbroker"
)

// Test helpers that talk to the real broker directly, beside the adapter.

var (
	brokerAddr = testbroker.Addr("CUSTODY_RABBITMQ_ADDR", "127.0.0.1:5672")
	brokerURL  = "amqp://guest:guest@" + brokerAddr + "/"
)

// admin is a plain amqp091 connection the test uses to set up queues,
// publish and inspect.
type admin struct {
	t    testing.TB
	conn *amqp.Connection
	ch   *amqp.Channel
}

func newAdmin(t testing.TB) *admin {
	t.Helper()
	testbroker.Dial(t, "RabbitMQ", brokerAddr)
	conn, err := amqp.Dial(brokerURL)
	if err != nil {
		testbroker.Unavailable(t, "RabbitMQ at "+brokerAddr, err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	a := &admin{t: t, conn: conn, ch: ch}
	t.Cleanup(func() { conn.Close() })
	return a
}

func uniqueName(t testing.TB, kind string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	name := strings.NewReplacer("/", "-", " ", "-").Replace(t.Name())
	if len(name) > 60 {
		name = name[:60]
	}
	return fmt.Sprintf("custody-test-%s-%s-%s", kind, name, hex.EncodeToString(b[:]))
}

// queue declares a fresh durable queue and deletes it, and any delay queues
// the adapter made for it, when the test ends.
func (a *admin) queue(typ QueueType, args amqp.Table) string {
	a.t.Helper()
	name := uniqueName(a.t, typ.String())
	a.declare(name, typ, args)
	return name
}

func (a *admin) declare(name string, typ QueueType, args amqp.Table) {
	a.t.Helper()
	all := amqp.Table{}
	for k, v := range args {
		all[k] = v
	}
	if typ == QuorumQueue {
		all["x-queue-type"] = "quorum"
	}
	if _, err := a.ch.QueueDeclare(name, true, false, false, false, all); err != nil {
		a.t.Fatalf("declare %s: %v", name, err)
	}
	a.t.Cleanup(func() { deleteQueues(name) })
}

// deleteQueues deletes queue and its delay queues on a connection of its own
// (the test's may be closed by then).
func deleteQueues(queue string) {
	conn, err := amqp.Dial(brokerURL)
	if err != nil {
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	_, _ = ch.QueueDelete(queue, false, false, false)
	for _, step := range delayLadder {
		_, _ = ch.QueueDelete(delayQueueName(queue, step), false, false, false)
	}
}

// exchangeTo declares a direct exchange, deleted when the test ends, that
// routes key to queue, and returns its name.
func (a *admin) exchangeTo(queue, key string) string {
	a.t.Helper()
	ex := uniqueName(a.t, "ex")
	if err := a.ch.ExchangeDeclare(ex, "direct", false, true, false, false, nil); err != nil {
		a.t.Fatal(err)
	}
	a.t.Cleanup(func() { a.ch.ExchangeDelete(ex, false, false) })
	if err := a.ch.QueueBind(queue, key, ex, false, nil); err != nil {
		a.t.Fatal(err)
	}
	return ex
}

// publish puts messages with the given bodies on queue, message ids equal to
// the bodies, and waits for the broker's confirms.
func (a *admin) publish(queue string, bodies ...string) {
	a.t.Helper()
	for _, b := range bodies {
		a.publishMsg(queue, amqp.Publishing{MessageId: b, Body: []byte(b), DeliveryMode: amqp.Persistent})
	}
}

func (a *admin) publishMsg(queue string, p amqp.Publishing) {
	a.t.Helper()
	dc, err := a.ch.PublishWithDeferredConfirm("", queue, true, false, p)
	if err != nil {
		a.t.Fatal(err)
	}
	if !dc.Wait() {
		a.t.Fatalf("publish to %s not confirmed", queue)
	}
}

// ready returns the number of messages ready in queue (not counting those
// delivered and unacked).
func (a *admin) ready(queue string) int {
	a.t.Helper()
	q, err := a.ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		a.t.Fatalf("inspect %s: %v", queue, err)
	}
	return q.Messages
}

// get takes every ready message off queue.
func (a *admin) drain(queue string) []amqp.Delivery {
	a.t.Helper()
	var out []amqp.Delivery
	for {
		m, ok, err := a.ch.Get(queue, true)
		if err != nil {
			a.t.Fatalf("get from %s: %v", queue, err)
		}
		if !ok {
			return out
		}
		out = append(out, m)
	}
}

// waitReady polls until queue holds want ready messages.
func (a *admin) waitReady(queue string, want int) {
	a.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		n := a.ready(queue)
		if n == want {
			return
		}
		if time.Now().After(deadline) {
			a.t.Fatalf("queue %s holds %d ready messages, want %d", queue, n, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// unacked asks rabbitmqctl how many deliveries of queue are unacknowledged:
// the broker's own count, which the client cannot see.
func unacked(t testing.TB, queue string) int {
	t.Helper()
	return queueInfo(t, queue, "messages_unacknowledged")
}

// queueInfo asks rabbitmqctl for one of queue's counts (list_queues item).
func queueInfo(t testing.TB, queue, item string) int {
	t.Helper()
	out, err := exec.Command("rabbitmqctl", "list_queues", "-q", "--no-table-headers", "name", item).Output()
	if err != nil {
		testbroker.Unavailable(t, "rabbitmqctl (to inspect the broker)", err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && f[0] == queue {
			n, err := strconv.Atoi(f[1])
			if err != nil {
				t.Fatalf("rabbitmqctl: %q", line)
			}
			return n
		}
	}
	t.Fatalf("rabbitmqctl does not list queue %s", queue)
	return 0
}

// waitUnacked polls the broker until queue has want unacked deliveries.
func waitUnacked(t testing.TB, queue string, want int) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		n := unacked(t, queue)
		if n == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("queue %s has %d unacked deliveries, want %d", queue, n, want)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// openSource opens a Source on queue with the test's broker and options, and
// closes it when the test ends.
func openSource(t testing.TB, queue string, opts ...Option) *Source {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := New(ctx, queue, append([]Option{WithURL(brokerURL)}, opts...)...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// receiveN receives until it holds n deliveries.
func receiveN(t testing.TB, s *Source, n int) []*adapters.Delivery {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var ds []*adapters.Delivery
	for len(ds) < n {
		got, err := s.Receive(ctx, n-len(ds))
		if err != nil {
			t.Fatalf("Receive after %d of %d: %v", len(ds), n, err)
		}
		ds = append(ds, got...)
	}
	return ds
}

func bodies(ds []*adapters.Delivery) []string {
	out := make([]string, len(ds))
	for i, d := range ds {
		out[i] = string(d.Body)
	}
	return out
}

func names(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s%d", prefix, i+1)
	}
	return out
}
