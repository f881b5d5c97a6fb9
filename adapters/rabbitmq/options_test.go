package rabbitmq

import (
	"context"
	"crypto/tls"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
)

// Invalid options fail at construction, before any connection, with an error
// that names the option.
func TestInvalidOptionsNameTheOption(t *testing.T) {
	cases := []struct {
		opt  Option
		name string
	}{
		{WithPrefetch(0), "WithPrefetch"},
		{WithPrefetch(70000), "WithPrefetch"},
		{WithURL(""), "WithURL"},
		{WithURL("http://x"), "WithURL"},
		{WithConsumerTag(""), "WithConsumerTag"},
		{WithConsumerTag(strings.Repeat("t", 256)), "WithConsumerTag"},
		{WithDeclare(QueueType(9), nil), "WithDeclare"},
		{WithDeclare(CheckQueue, amqp.Table{"x-max-length": 1}), "WithDeclare"},
		{WithDeclare(ClassicQueue, amqp.Table{"x-queue-type": "quorum"}), "WithDeclare"},
		{WithConsumerTimeout(0), "WithConsumerTimeout"},
		{WithReconnectBackoff(0, time.Second), "WithReconnectBackoff"},
		{WithReconnectBackoff(time.Second, time.Millisecond), "WithReconnectBackoff"},
		{WithPollWait(0), "WithPollWait"},
		{WithTLS(nil), "WithTLS"},
		{WithDialFunc(nil), "WithDialFunc"},
		{WithLogger(nil), "WithLogger"},
		{WithMeterProvider(nil), "WithMeterProvider"},
		{WithConfig(amqp.Config{Recovery: &amqp.Recovery{}}), "Recovery"},
	}
	for _, c := range cases {
		_, err := New(context.Background(), "q", WithURL("amqp://nowhere.invalid:1/"), c.opt)
		if err == nil || !strings.Contains(err.Error(), c.name) {
			t.Errorf("want an error naming %s, got %v", c.name, err)
		}
	}
	_, err := New(context.Background(), "q", WithURL("amqp://x:1/"), WithDialFunc(func(context.Context) (*amqp.Connection, error) { return nil, nil }))
	if err == nil || !strings.Contains(err.Error(), "WithDialFunc") {
		t.Errorf("URL and dial function together: %v", err)
	}
	if _, err := New(context.Background(), ""); err == nil {
		t.Error("empty queue name accepted")
	}
	// Names travel as AMQP short strings: refused before any connection.
	long := strings.Repeat("q", 256)
	if _, err := New(context.Background(), long, WithURL("amqp://nowhere.invalid:1/")); err == nil || !strings.Contains(err.Error(), "at most 255") {
		t.Errorf("256-byte queue name: %v", err)
	}
	for _, c := range []struct{ exchange, key, what string }{{long, "k", "exchange name"}, {"", long, "routing key"}} {
		_, err := NewDeadLetter(context.Background(), c.exchange, c.key, WithURL("amqp://nowhere.invalid:1/"))
		if err == nil || !strings.Contains(err.Error(), c.what) {
			t.Errorf("256-byte %s: %v", c.what, err)
		}
	}
}

// The consumer tag is an AMQP short string like the queue name: the default
// one, which embeds the queue name, must fit for every valid name.
func TestLongQueueNameGetsAConsumerTagThatFits(t *testing.T) {
	a := newAdmin(t)
	q := "custody-test-long-" + randomSuffix() + "-"
	q += strings.Repeat("é", (maxShortstr-len(q))/2) // 255 bytes, two-byte characters at the end
	if len(q) != maxShortstr {
		t.Fatalf("queue name of %d bytes", len(q))
	}
	a.declare(q, ClassicQueue, nil)
	a.publish(q, "m1")
	s := openSource(t, q, WithPrefetch(10))
	if len(s.tag) > maxShortstr || !utf8.ValidString(s.tag) {
		t.Fatalf("consumer tag of %d bytes, valid UTF-8 %v", len(s.tag), utf8.ValidString(s.tag))
	}
	d := receiveN(t, s, 1)[0]
	if err := s.Ack(context.Background(), []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
	waitUnacked(t, q, 0)
}

func TestNewFailsOnMissingQueue(t *testing.T) {
	newAdmin(t)
	_, err := New(context.Background(), "custody-test-no-such-queue", WithURL(brokerURL))
	if err == nil || !strings.Contains(err.Error(), "WithDeclare") || !strings.Contains(err.Error(), "custody-test-no-such-queue") {
		t.Fatalf("New on a missing queue: %v", err)
	}
}

func TestNewFailsOnUnreachableBroker(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := New(ctx, "q", WithURL("amqp://guest:secret@127.0.0.1:1/"))
	if err == nil {
		t.Fatal("New succeeded with no broker")
	}
	if strings.Contains(err.Error(), "secret") {
		t.Fatalf("error shows the password: %v", err)
	}
}

// The dial function is used for the first connection and every reconnect.
func TestDialFuncIsUsedForEveryConnection(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	var dials atomic.Int32
	s2, err := New(context.Background(), q, WithDialFunc(func(ctx context.Context) (*amqp.Connection, error) {
		dials.Add(1)
		return amqp.Dial(brokerURL)
	}), WithReconnectBackoff(10*time.Millisecond, 50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	killConnection(t, s2)
	waitGenerations(t, s2, 2)
	if dials.Load() != 2 {
		t.Fatalf("dial function called %d times, want 2", dials.Load())
	}
	a.publish(q, "m1")
	d := receiveN(t, s2, 1)[0]
	if err := s2.Ack(context.Background(), []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
}

// A quorum queue the Source declares reports attempts from the broker.
func TestDeclareQuorumQueue(t *testing.T) {
	a := newAdmin(t)
	q := uniqueName(t, "quorum")
	t.Cleanup(func() { deleteQueues(q) })
	s := openSource(t, q, WithDeclare(QuorumQueue, amqp.Table{"x-delivery-limit": int64(10)}))
	if c := s.Capabilities(); !c.CountsDeliveries || c.NackDelay || c.Lease != 0 || c.Name != "rabbitmq:"+q {
		t.Fatalf("capabilities %+v", c)
	}
	a.publish(q, "m1")
	d := receiveN(t, s, 1)[0]
	if d.Attempt != 1 || d.Queue != q || d.Partition != -1 || d.Offset != -1 {
		t.Fatalf("delivery %+v", d)
	}
	var native amqp.Delivery
	if !d.As(&native) || native.RoutingKey != q || native.Acknowledger != nil {
		t.Fatalf("As(amqp.Delivery): %v, routing key %q, acknowledger %v", d.As(&native), native.RoutingKey, native.Acknowledger)
	}
}

// amqp091 writes into the configuration it dials with (its capabilities
// into the client properties, the host into an empty TLS server name). The
// adapter dials for every reconnect and for its publisher, at times at once,
// and a service hands the same configuration to its Source and its
// dead-letter sink: each dial must work on copies, or the dials race on the
// caller's map (under -race: a reported race; in production: at worst a
// fatal concurrent map write).
func TestDialsLeaveTheCallersConfigAlone(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	props := amqp.NewConnectionProperties()
	props.SetClientConnectionName("custody-test")
	want := len(props)
	cfg := amqp.Config{Properties: props}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Add(2)
		go func() {
			defer wg.Done()
			s, err := New(ctx, q, WithURL(brokerURL), WithConfig(cfg))
			if err != nil {
				t.Error(err)
				return
			}
			s.Close()
		}()
		go func() {
			defer wg.Done()
			x, err := NewDeadLetter(ctx, "", q, WithURL(brokerURL), WithConfig(cfg))
			if err != nil {
				t.Error(err)
				return
			}
			x.Close()
		}()
	}
	wg.Wait()
	if len(props) != want {
		t.Errorf("the caller's client properties were written to: %v", props)
	}

	// Dialing amqps:// at the plain port fails the TLS handshake, after
	// amqp091 filled in the server name.
	tlsCfg := &tls.Config{}
	if _, err := New(ctx, q, WithURL("amqps://guest:guest@"+brokerAddr+"/"), WithTLS(tlsCfg)); err == nil {
		t.Fatal("TLS to the plain AMQP port succeeded")
	}
	if tlsCfg.ServerName != "" {
		t.Errorf("the caller's TLS configuration was written to: ServerName %q", tlsCfg.ServerName)
	}
}
