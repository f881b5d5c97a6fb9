package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testbroker"
)

// killConnection closes the current generation's connection from the
// broker's side (rabbitmqctl close_connection), as an operator or a network
// failure would.
func killConnection(t *testing.T, s *Source) {
	t.Helper()
	s.mu.Lock()
	g := s.gen
	s.mu.Unlock()
	if g == nil {
		t.Fatal("no live generation to kill")
	}
	if err := closeFromBroker(g.conn); errors.Is(err, errNoRabbitmqctl) {
		testbroker.Unavailable(t, "rabbitmqctl (to inspect the broker)", err)
	} else if err != nil {
		t.Fatal(err)
	}
}

// errNoRabbitmqctl is wrapped when rabbitmqctl cannot list the connections.
var errNoRabbitmqctl = errors.New("rabbitmqctl list_connections failed")

// closeFromBroker makes the broker close conn (rabbitmqctl close_connection).
func closeFromBroker(conn *amqp.Connection) error {
	port := strconv.Itoa(conn.LocalAddr().(*net.TCPAddr).Port)
	out, err := exec.Command("rabbitmqctl", "list_connections", "-q", "--no-table-headers", "pid", "peer_port").Output()
	if err != nil {
		return fmt.Errorf("%w: %v", errNoRabbitmqctl, err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && f[1] == port {
			if out, err := exec.Command("rabbitmqctl", "close_connection", f[0], "custody test: forced close").CombinedOutput(); err != nil {
				return fmt.Errorf("rabbitmqctl close_connection: %v: %s", err, out)
			}
			return nil
		}
	}
	return fmt.Errorf("rabbitmqctl does not list a connection from port %s:\n%s", port, out)
}

func waitGenerations(t *testing.T, s *Source, n uint64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for s.Stats().Generations < n {
		if time.Now().After(deadline) {
			t.Fatalf("still %d generations, want %d", s.Stats().Generations, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// After a reconnect the new channel numbers its deliveries from 1 again.
// Acks for deliveries of the dead channel must be dropped, not sent on the
// new one, where the same tags name other messages.
func TestReconnectNeverAcksAcrossGenerations(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 6)...)
	s := openSource(t, q, WithPrefetch(3), WithReconnectBackoff(10*time.Millisecond, 100*time.Millisecond))
	old := receiveN(t, s, 3)
	killConnection(t, s)
	for _, d := range old {
		select {
		case <-d.Signal.Lost():
		case <-time.After(30 * time.Second):
			t.Fatal("delivery of the dead channel was not lost")
		}
		if !errors.Is(d.Signal.LostCause(), adapters.ErrConnectionLost) {
			t.Fatalf("lost cause %v, want ErrConnectionLost", d.Signal.LostCause())
		}
	}
	waitGenerations(t, s, 2)
	fresh := receiveN(t, s, 3)
	for _, d := range fresh {
		if handleOf(d).gen.id != 2 {
			t.Fatalf("delivery from generation %d after the reconnect", handleOf(d).gen.id)
		}
	}
	// The runtime finishes the old deliveries late and acks them.
	err := s.Ack(context.Background(), old)
	var be *adapters.BatchError
	if !errors.As(err, &be) || len(be.Failed) != 3 || !errors.Is(be.Failed[0], adapters.ErrConnectionLost) {
		t.Fatalf("Ack of dead-channel deliveries returned %v, want a BatchError of ErrConnectionLost for all three", err)
	}
	time.Sleep(50 * time.Millisecond) // give a wrongly sent ack time to land
	if n := unacked(t, q); n != 3 {
		t.Fatalf("broker shows %d unacked; the three fresh deliveries must all still be unacked", n)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	a.waitReady(q, 6) // nothing was acked, so nothing is gone
	if st := s.Stats(); st.AckFrames != 0 || st.DroppedAcks != 3 {
		t.Fatalf("stats %+v: want no ack sent and the three stale acks dropped", st)
	}
}

// While the broker cannot be reached, Receive reports the reconnection error
// (so the runtime logs it) and consumption resumes once it can.
func TestReceiveReportsReconnectFailureAndResumes(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	var refuse atomic.Bool
	s, err := New(context.Background(), q, WithDialFunc(func(ctx context.Context) (*amqp.Connection, error) {
		if refuse.Load() {
			return nil, errors.New("test: broker unreachable")
		}
		return amqp.Dial(brokerURL)
	}), WithReconnectBackoff(10*time.Millisecond, 50*time.Millisecond), WithPollWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	refuse.Store(true)
	killConnection(t, s)
	ctx := context.Background()
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := s.Receive(ctx, 10)
		if err != nil {
			if !strings.Contains(err.Error(), "reconnecting") || !strings.Contains(err.Error(), "broker unreachable") {
				t.Fatalf("Receive error %q does not say the adapter is reconnecting and why", err)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("Receive never reported the failing reconnection")
		}
	}
	refuse.Store(false)
	a.publish(q, "m1")
	var got []*adapters.Delivery
	for len(got) == 0 {
		ds, err := s.Receive(ctx, 10)
		if err != nil && time.Now().After(deadline) {
			t.Fatalf("no recovery: %v", err)
		}
		got = append(got, ds...)
	}
	if err := s.Ack(ctx, got); err != nil {
		t.Fatal(err)
	}
	waitUnacked(t, q, 0)
}

// recordLog keeps every record as one line: its message and attributes.
type recordLog struct {
	mu    sync.Mutex
	lines []string
}

func (l *recordLog) Enabled(context.Context, slog.Level) bool { return true }
func (l *recordLog) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l *recordLog) WithGroup(string) slog.Handler            { return l }
func (l *recordLog) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool {
		fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
		return true
	})
	l.mu.Lock()
	l.lines = append(l.lines, b.String())
	l.mu.Unlock()
	return nil
}

// with returns the lines that contain s.
func (l *recordLog) with(s string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, line := range l.lines {
		if strings.Contains(line, s) {
			out = append(out, line)
		}
	}
	return out
}

// A broker that cannot be reached for several reconnection attempts is
// reported once, with the address tried and the error, by the adapter and
// the runtime together (sharing one logger, as a service does), and once
// more when the attempts start failing another way; so are the loss of the
// connection and the reconnection. Not once per failed attempt, by the
// adapter and again by the runtime from Receive.
func TestReconnectTroubleIsLoggedOncePerChange(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	logs := &recordLog{}
	logger := slog.New(logs)
	var refusing atomic.Bool
	var refused atomic.Int32
	dial := func(network, addr string) (net.Conn, error) {
		// Refuse at least five attempts, and until the trouble was
		// reported; then fail in another way, reported again, for five
		// more.
		if refusing.Load() {
			n := refused.Add(1)
			if n < 5 || len(logs.with("broker unreachable")) == 0 {
				return nil, errors.New("test: broker unreachable")
			}
			if n < 10 || len(logs.with("test: handshake refused")) == 0 {
				return nil, errors.New("test: handshake refused")
			}
			refusing.Store(false)
		}
		return net.Dial(network, addr)
	}
	s := openSource(t, q, WithConfig(amqp.Config{Dial: dial}), WithReconnectBackoff(10*time.Millisecond, 20*time.Millisecond),
		WithPollWait(20*time.Millisecond), WithLogger(logger))
	var h handled
	runConsumer(t, s, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		h.add(m.ID)
		return nil
	}), consumer.WithLogger(logger))
	refusing.Store(true)
	killConnection(t, s)
	waitGenerations(t, s, 2)
	a.publish(q, "m1")
	waitUntil(t, "m1 handled after the reconnection", func() bool { return h.distinct() == 1 })
	if n := refused.Load(); n < 10 {
		t.Fatalf("%d attempts refused, want at least 10", n)
	}
	host, _, _ := net.SplitHostPort(brokerAddr)
	for _, cause := range []string{"broker unreachable", "handshake refused"} {
		var trouble []string
		for _, line := range logs.with(cause) {
			if !strings.Contains(line, "reconnected") {
				trouble = append(trouble, line)
			}
		}
		if len(trouble) != 1 || !strings.Contains(trouble[0], "amqp://guest:xxxxx@"+host) {
			t.Errorf("the reconnection failing with %q was logged %d times, want once with the address %s:\n%s", cause, len(trouble), host, strings.Join(trouble, "\n"))
		}
	}
	if lost := logs.with("lost the channel"); len(lost) != 1 {
		t.Errorf("the lost connection was logged %d times, want once:\n%s", len(lost), strings.Join(lost, "\n"))
	}
	if back := logs.with("reconnected"); len(back) != 1 || !strings.Contains(back[0], "handshake refused") {
		t.Errorf("the reconnection was logged %d times, want once with the last error:\n%s", len(back), strings.Join(back, "\n"))
	}
}

// killConnectionAndHoldSupervisor kills s's connection and returns once
// amqp091 saw it close, holding the supervisor before it marks the
// generation dead, until release is called.
func killConnectionAndHoldSupervisor(t *testing.T, s *Source) (release func()) {
	t.Helper()
	died, held := make(chan struct{}), make(chan struct{})
	s.mu.Lock()
	s.testHookChannelDied = func() {
		close(died)
		<-held
	}
	s.mu.Unlock()
	killConnection(t, s)
	select {
	case <-died: // the connection is closed; the generation is not yet dead
	case <-time.After(30 * time.Second):
		t.Fatal("the supervisor did not see the connection close")
	}
	return func() {
		s.mu.Lock()
		s.testHookChannelDied = nil
		s.mu.Unlock()
		close(held)
	}
}

// An Ack that arrives after amqp091 saw the connection close, but before
// the adapter marked the generation dead, cannot reach the broker, which
// redelivers the message: Ack must report the delivery lost, not settled,
// or the runtime counts as acked a message that comes back.
func TestAckAfterTheConnectionClosedReportsTheLoss(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "m1")
	s := openSource(t, q, WithPrefetch(10), WithReconnectBackoff(10*time.Millisecond, 100*time.Millisecond))
	d := receiveN(t, s, 1)[0]
	release := killConnectionAndHoldSupervisor(t, s)
	err := s.Ack(context.Background(), []*adapters.Delivery{d})
	release()
	if !errors.Is(adapters.EntryError(err, 0), adapters.ErrConnectionLost) {
		t.Errorf("Ack after the connection closed returned %v, want ErrConnectionLost: the broker redelivers the message", err)
	}
	again := receiveN(t, s, 1)[0]
	if again.ID != "m1" {
		t.Fatalf("redelivered %q, want m1", again.ID)
	}
	if err := s.Ack(context.Background(), []*adapters.Delivery{again}); err != nil {
		t.Fatal(err)
	}
}

// waitLog records the "waited" value of each reconnection the adapter logs.
type waitLog struct {
	mu     sync.Mutex
	waited []time.Duration
}

func (l *waitLog) Enabled(context.Context, slog.Level) bool { return true }
func (l *waitLog) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l *waitLog) WithGroup(string) slog.Handler            { return l }
func (l *waitLog) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "rabbitmq: reconnected" {
		return nil
	}
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "waited" {
			l.mu.Lock()
			l.waited = append(l.waited, a.Value.Duration())
			l.mu.Unlock()
		}
		return true
	})
	return nil
}

func (l *waitLog) snapshot() []time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.waited)
}

// Connections that die soon after they start, one after another (the broker
// closing each at once: a message it cannot deliver, an operator's policy),
// are redialled after a growing wait, not about ten times a second for
// ever, the prefetch window redelivered each time.
func TestConnectionsDyingAtOnceBackOff(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	var flapping atomic.Bool
	flapping.Store(true)
	logs := &waitLog{}
	s, err := New(context.Background(), q, WithLogger(slog.New(logs)), WithReconnectBackoff(20*time.Millisecond, 10*time.Second),
		WithDialFunc(func(ctx context.Context) (*amqp.Connection, error) {
			conn, err := amqp.Dial(brokerURL)
			if err == nil && flapping.Load() {
				// Up long enough to start consuming, then gone.
				time.AfterFunc(200*time.Millisecond, func() { conn.Close() })
			}
			return conn, err
		}))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	waitUntil(t, "four reconnections", func() bool { return len(logs.snapshot()) >= 4 })
	flapping.Store(false)
	w := logs.snapshot()[:4]
	for i := 1; i < len(w); i++ {
		if w[i] <= w[i-1] {
			t.Fatalf("waits before reconnecting %v: connections that died at once did not make the next wait longer", w)
		}
	}
}

// A queue deleted under a consumer (an operator, a redeploy that re-creates
// it): the broker cancels the consumer while its channel stays open. The
// deliveries in hand are lost with a cause that says so, their acks are
// refused rather than sent for messages that no longer exist, and once the
// queue exists again consumption resumes on its own.
func TestDeletedQueueLosesItsDeliveriesAndResumesOnceItIsBack(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 3)...)
	s := openSource(t, q, WithPrefetch(3), WithReconnectBackoff(10*time.Millisecond, 100*time.Millisecond),
		WithPollWait(50*time.Millisecond))
	old := receiveN(t, s, 3)
	if _, err := a.ch.QueueDelete(q, false, false, false); err != nil {
		t.Fatal(err)
	}
	for _, d := range old {
		select {
		case <-d.Signal.Lost():
		case <-time.After(30 * time.Second):
			t.Fatal("a delivery of the deleted queue was not lost")
		}
		if !errors.Is(d.Signal.LostCause(), adapters.ErrConnectionLost) || !strings.Contains(d.Signal.LostCause().Error(), "cancelled consumer") {
			t.Fatalf("lost cause %v, want ErrConnectionLost saying the broker cancelled the consumer", d.Signal.LostCause())
		}
	}
	err := s.Ack(context.Background(), old)
	for i := range old {
		if e := adapters.EntryError(err, i); !errors.Is(e, adapters.ErrConnectionLost) {
			t.Fatalf("Ack of the deleted queue's delivery %d = %v, want ErrConnectionLost", i, e)
		}
	}

	a.declare(q, ClassicQueue, nil)
	a.publish(q, "after")
	// Receive reports the failing reconnections until the queue is back.
	var got []*adapters.Delivery
	for deadline := time.Now().Add(30 * time.Second); len(got) == 0; {
		ds, err := s.Receive(context.Background(), 1)
		if len(ds) == 0 && time.Now().After(deadline) {
			t.Fatalf("no recovery once the queue was back (last error %v)", err)
		}
		got = append(got, ds...)
	}
	if string(got[0].Body) != "after" {
		t.Fatalf("received %q after the queue came back, want \"after\"", got[0].Body)
	}
	if err := s.Ack(context.Background(), got); err != nil {
		t.Fatal(err)
	}
	waitUnacked(t, q, 0)
	if n := a.ready(q); n != 0 {
		t.Fatalf("%d messages ready after the ack, want 0", n)
	}
}

// Deliveries the broker sent that wait in the Source, not yet received,
// when the channel dies are lost with it, and the broker sends them again on
// the next channel: Receive hands out those fresh copies only, never the
// dead channel's, which no ack could settle.
func TestDeliveriesWaitingWhenTheChannelDiesAreNotHandedOut(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 3)...)
	s := openSource(t, q, WithPrefetch(10), WithReconnectBackoff(10*time.Millisecond, 100*time.Millisecond))
	waitUntil(t, "the three deliveries to wait in the Source", func() bool { return s.Stats().Delivered == 3 })
	killConnection(t, s)
	waitGenerations(t, s, 2)
	waitUntil(t, "the three lost ones to be counted", func() bool { return s.Stats().Lost == 3 })

	ds := receiveN(t, s, 3)
	for _, d := range ds {
		if cause := d.Signal.LostCause(); cause != nil {
			t.Fatalf("Receive handed out %s, lost with the dead channel: %v", d.Body, cause)
		}
		if g := handleOf(d).gen.id; g != 2 {
			t.Fatalf("Receive handed out %s from generation %d, want 2", d.Body, g)
		}
	}
	got := bodies(ds)
	slices.Sort(got)
	if !slices.Equal(got, names("m", 3)) {
		t.Fatalf("received %v, want m1 to m3 once each", got)
	}
	if err := s.Ack(context.Background(), ds); err != nil {
		t.Fatalf("Ack of the redelivered messages: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if n := a.ready(q); n != 0 {
		t.Fatalf("%d messages left after the redelivered ones were acked", n)
	}
}

// muteRelay stands between the adapter and the broker, on a port of its
// own. Once muted, it stops passing anything on, either way, and accepts new
// connections without ever answering them: a broker that hangs, or a load
// balancer in front of one that is down.
type muteRelay struct {
	ln       net.Listener
	muted    atomic.Bool
	accepted chan struct{} // one for each handshake begun while muted
	mu       sync.Mutex
	conns    []net.Conn
	wg       sync.WaitGroup
}

func startMuteRelay(t *testing.T) *muteRelay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &muteRelay{ln: ln, accepted: make(chan struct{}, 64)}
	r.wg.Add(1)
	go r.serve()
	t.Cleanup(func() {
		ln.Close()
		r.mu.Lock()
		for _, c := range r.conns {
			c.Close()
		}
		r.mu.Unlock()
		r.wg.Wait()
	})
	return r
}

func (r *muteRelay) url() string { return "amqp://guest:guest@" + r.ln.Addr().String() + "/" }

func (r *muteRelay) keep(c net.Conn) {
	r.mu.Lock()
	r.conns = append(r.conns, c)
	r.mu.Unlock()
}

func (r *muteRelay) serve() {
	defer r.wg.Done()
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return
		}
		r.keep(c)
		if r.muted.Load() {
			r.wg.Add(1)
			go func() {
				defer r.wg.Done()
				// The client's protocol header: it waits in the handshake.
				if _, err := io.ReadFull(c, make([]byte, 8)); err == nil {
					r.accepted <- struct{}{}
				}
			}()
			continue
		}
		b, err := net.DialTimeout("tcp", brokerAddr, 10*time.Second)
		if err != nil {
			c.Close()
			continue
		}
		r.keep(b)
		r.wg.Add(2)
		go r.pass(b, c)
		go r.pass(c, b)
	}
}

// pass copies from src to dst until either closes, dropping what it reads
// once muted.
func (r *muteRelay) pass(dst, src net.Conn) {
	defer r.wg.Done()
	defer dst.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !r.muted.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// Close during a reconnect returns at once, even while the reconnect waits
// for a broker that accepted the connection and does not answer: in the AMQP
// handshake, or (the connection made) in opening the channel and the
// consumer. Those waits have no context of their own; Close must not wait
// for their timeouts (the handshake's 30 s, three heartbeats), nor must
// Run's return.
func TestCloseDuringAReconnectToABrokerThatDoesNotAnswer(t *testing.T) {
	for _, hang := range []string{"handshake", "channel"} {
		t.Run(hang, func(t *testing.T) {
			a := newAdmin(t)
			q := a.queue(ClassicQueue, nil)
			was := handshakeTimeout
			handshakeTimeout = time.Hour // so that only Close can end the wait
			t.Cleanup(func() { handshakeTimeout = was })
			r := startMuteRelay(t)
			var muteOnDial atomic.Bool
			conn := WithURL(r.url())
			if hang == "channel" {
				conn = WithDialFunc(func(ctx context.Context) (*amqp.Connection, error) {
					// Heartbeats an hour apart: amqp091 gives up on a
					// silent broker only after three of them.
					c, err := amqp.DialConfig(r.url(), amqp.Config{Heartbeat: time.Hour})
					if err == nil && muteOnDial.Load() {
						r.muted.Store(true)
						r.accepted <- struct{}{} // connected; the channel is next
					}
					return c, err
				})
			}
			s, err := New(context.Background(), q, conn, WithReconnectBackoff(10*time.Millisecond, 50*time.Millisecond))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			if hang == "handshake" {
				r.muted.Store(true)
			} else {
				muteOnDial.Store(true)
			}
			r.mu.Lock()
			for _, c := range r.conns {
				c.Close() // the connection dies; the adapter reconnects
			}
			r.conns = nil
			r.mu.Unlock()
			select {
			case <-r.accepted:
			case <-time.After(30 * time.Second):
				t.Fatal("the adapter did not reconnect")
			}
			closed := make(chan error, 1)
			go func() { closed <- s.Close() }()
			select {
			case err := <-closed:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(60 * time.Second):
				t.Fatal("Close waits for a reconnect the broker does not answer")
			}
		})
	}
}

// Close on a live connection to a broker that stops answering returns in
// about the close timeout. amqp091 waits for the broker's answer to
// channel.close with no limit of its own, only its heartbeat timeout (about
// 30 s with the default heartbeat; an hour here), so Close, and the
// runtime's shutdown with it, outlasted a deployment's grace period. The
// dead-letter sink's Close is held to the same bound.
func TestCloseOnALiveConnectionToABrokerThatStopsAnswering(t *testing.T) {
	for _, closer := range []string{"source", "dead-letter sink"} {
		t.Run(closer, func(t *testing.T) {
			a := newAdmin(t)
			q := a.queue(ClassicQueue, nil)
			r := startMuteRelay(t)
			// Heartbeats an hour apart: amqp091 gives up on a silent
			// broker only after three of them.
			dial := WithDialFunc(func(ctx context.Context) (*amqp.Connection, error) {
				return amqp.DialConfig(r.url(), amqp.Config{Heartbeat: time.Hour})
			})
			var c interface{ Close() error }
			var closeTimeout time.Duration
			if closer == "source" {
				a.publish(q, "held", "acked")
				s, err := New(context.Background(), q, dial)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { s.Close() })
				var ds []*adapters.Delivery
				for deadline := time.Now().Add(30 * time.Second); len(ds) < 2; {
					if time.Now().After(deadline) {
						t.Fatalf("received %d deliveries, want 2", len(ds))
					}
					got, err := s.Receive(context.Background(), 2)
					if err != nil {
						t.Fatal(err)
					}
					ds = append(ds, got...)
				}
				// One ack pending (Close sends it into the silence), one
				// delivery still held.
				if err := s.Ack(context.Background(), ds[1:]); err != nil {
					t.Fatal(err)
				}
				c, closeTimeout = s, s.s.closeTimeout
			} else {
				x, err := NewDeadLetter(context.Background(), "", q, dial)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { x.Close() })
				c, closeTimeout = x, x.pub.s.closeTimeout
			}
			r.muted.Store(true)
			closed := make(chan error, 1)
			go func() { closed <- c.Close() }()
			// Generous for a loaded machine, and far below the hour the
			// unbounded wait lasts.
			bound := 12 * closeTimeout
			select {
			case err := <-closed:
				t.Logf("Close: %v", err)
			case <-time.After(bound):
				t.Fatalf("Close still waits after %v for a broker that does not answer (close timeout %v)", bound, closeTimeout)
			}
		})
	}
}
