package crashbench

import (
	"bufio"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"
)

// hang bounds how long a run waits for an effect before it gives up: a
// guard against a stuck consumer, far beyond any normal pause.
const hang = 90 * time.Second

// broker is a broker as the parent sees it: it makes streams of messages.
type broker struct {
	name string
	// open makes a fresh, empty queue or topic.
	open func(tb testing.TB) *stream
}

// stream is one fresh queue or topic.
type stream struct {
	env []string // what a child needs to read the stream (envAddr, ...)
	// publish adds messages with the given bodies and returns once the
	// broker has them. It may run beside the other calls.
	publish func(bodies []string) error
	// settle is how long after the last kill the last child must run on
	// before it may stop: until what a killed child held is delivered again
	// (SQS: its visibility timeout). Zero where the broker hands it back at
	// once.
	settle time.Duration
	// leftover counts, once no child runs, the messages the broker would
	// still deliver to a consumer: each is an effect still to be repeated.
	leftover func() int
}

// tally is what a run saw.
type tally struct {
	counts   map[string]int // effects per message body published
	distinct int            // messages with at least one effect
	effects  int            // effects recorded
	unknown  int            // effects of bodies never published
	kills    int            // SIGKILLs sent
	leftover int            // deliveries still due at the end (see stream.leftover)

	first, done time.Time // the first effect, and the one that completed the set
}

// expect adds n messages to those the tally waits for, and returns their
// bodies (all different from the others).
func (t *tally) expect(n int) []string {
	bodies := make([]string, n)
	for i := range bodies {
		bodies[i] = fmt.Sprintf("m%07d", len(t.counts))
		t.counts[bodies[i]] = 0
	}
	t.done = time.Time{}
	return bodies
}

func (t *tally) add(body string) {
	n, ok := t.counts[body]
	if !ok {
		t.unknown++
		return
	}
	now := time.Now()
	if t.effects == 0 {
		t.first = now
	}
	t.effects++
	t.counts[body] = n + 1
	if n == 0 {
		t.distinct++
		if t.distinct == len(t.counts) {
			t.done = now
		}
	}
}

// published is the number of messages published.
func (t *tally) published() int { return len(t.counts) }

// lost is the number of messages whose effect never happened.
func (t *tally) lost() int { return len(t.counts) - t.distinct }

// repeats is the number of effects beyond one per message, those still due
// included.
func (t *tally) repeats() int { return t.effects - t.distinct + t.leftover }

// rate is the messages per second from the first effect to the one that
// completed the set.
func (t *tally) rate() float64 {
	if t.done.IsZero() || len(t.counts) < 2 {
		return 0
	}
	return float64(len(t.counts)-1) / t.done.Sub(t.first).Seconds()
}

func (t *tally) String() string {
	return fmt.Sprintf("%d messages, %d lost, %d effects (%d repeated, %d of them still due), %d kills, %d unknown",
		len(t.counts), t.lost(), t.effects+t.leftover, t.repeats(), t.leftover, t.kills, t.unknown)
}

// quiet is how long the last child of a crash run must go without an
// effect before it is stopped: long enough for every redelivery due to
// reach it (a one-second poll and more), so that little is left for the
// broker to deliver after it.
const quiet = 1500 * time.Millisecond

// scenario says what a run does.
type scenario struct {
	messages int           // published at the start
	kills    int           // 0: a throughput run
	life     time.Duration // each kill falls at a moment uniform in this long after the child's first effect
	// backlog is how many messages without an effect the run keeps
	// published until the last kill, topping the stream up as they are
	// handled, so that no kill finds the stream run out (0: none).
	backlog int
}

// run has children of the reader role consume a fresh stream of b, killing
// sc.kills of them with SIGKILL at a moment uniform in the first sc.life
// after each one's first effect. The last child runs until every message
// has had an effect, the stream has settled and no effect came for a while,
// and is then stopped with SIGTERM. In a throughput run (no kills) the child
// is stopped once every message has had an effect.
func run(tb testing.TB, b broker, reader string, sc scenario) *tally {
	tb.Helper()
	s := b.open(tb)
	t := &tally{counts: map[string]int{}}
	if err := s.publish(t.expect(sc.messages)); err != nil {
		tb.Fatal(err)
	}
	// Top-ups run on a goroutine of their own, one at a time, so that the
	// effects are read meanwhile; their bodies are expected before they
	// are sent.
	var (
		topping   bool
		toppedUp  = make(chan error, 1)
		publishes sync.WaitGroup
	)
	defer publishes.Wait()
	topUp := func() {
		if topping || sc.backlog == 0 || t.kills == sc.kills || t.published()-t.distinct >= sc.backlog {
			return
		}
		topping = true
		bodies := t.expect(sc.backlog)
		publishes.Go(func() { toppedUp <- s.publish(bodies) })
	}

	role := b.name + "/" + reader
	var lastKill, lastEffect time.Time
	for stopped := false; !stopped; {
		c := startChild(tb, role, s.env)
		final := t.kills == sc.kills
		var (
			killAt           <-chan time.Time
			killed, stopping bool
			started          bool
			finishTimer      *time.Timer
		)
		// finish stops the last child once every message has had an
		// effect, what the killed children held has come back, and the
		// child has gone quiet; until then it sets a timer to look again.
		finish := func() {
			if !final || stopping || topping || t.distinct < t.published() {
				return
			}
			var at time.Time
			if sc.kills > 0 {
				at = lastEffect.Add(quiet)
				if !lastKill.IsZero() {
					at = later(at, lastKill.Add(s.settle))
				}
			}
			if wait := time.Until(at); wait > 0 {
				if finishTimer == nil {
					finishTimer = time.NewTimer(wait)
				} else {
					finishTimer.Reset(wait)
				}
				return
			}
			c.stop()
			stopping = true
		}
		finishC := func() <-chan time.Time {
			if finishTimer == nil || stopping {
				return nil
			}
			return finishTimer.C
		}
		finish()
		guard := time.NewTimer(hang)
	loop:
		for {
			select {
			case body, ok := <-c.lines:
				if !ok {
					break loop
				}
				t.add(body)
				lastEffect = time.Now()
				guard.Reset(hang)
				if !started && !final {
					started = true
					killAt = time.After(rand.N(sc.life))
				}
				topUp()
				finish()
			case err := <-toppedUp:
				if err != nil {
					c.kill()
					tb.Fatalf("topping the stream up: %v", err)
				}
				topping = false
				topUp()
				finish()
			case <-killAt:
				killAt = nil
				if t.distinct == t.published() {
					// The stream ran out: no message left to crash on.
					final = true
					finish()
					continue
				}
				c.kill()
				killed = true
				t.kills++
				lastKill = time.Now()
			case <-finishC():
				finish()
			case <-guard.C:
				c.kill()
				c.wait()
				tb.Fatalf("%s: no effect for %v, %d messages still without one (%v); child's stderr:\n%s", role, hang, t.lost(), t, c.stderr)
			}
		}
		guard.Stop()
		if finishTimer != nil {
			finishTimer.Stop()
		}
		err := c.wait()
		switch {
		case stopping:
			if err != nil {
				tb.Fatalf("%s: the last child failed its shutdown: %v; stderr:\n%s", role, err, c.stderr)
			}
			stopped = true
		case !killed:
			tb.Fatalf("%s: the child ended by itself (%v) after %v; stderr:\n%s", role, err, t, c.stderr)
		}
	}
	if sc.kills > 0 {
		t.leftover = s.leftover()
	}
	if t.unknown > 0 {
		tb.Errorf("%s: %d effects of messages never published", role, t.unknown)
	}
	return t
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// child is one consumer process.
type child struct {
	cmd    *exec.Cmd
	lines  chan string // its effects; closed when its pipe is drained
	stderr *headBuffer

	waitOnce sync.Once
	waitErr  error
}

// startChild starts the test binary again as a consumer of role, with env
// added to its environment.
func startChild(tb testing.TB, role string, env []string) *child {
	tb.Helper()
	exe, err := os.Executable()
	if err != nil {
		tb.Fatal(err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		tb.Fatal(err)
	}
	c := &child{lines: make(chan string, 1024), stderr: &headBuffer{}}
	c.cmd = exec.Command(exe)
	c.cmd.Env = append(os.Environ(), env...)
	c.cmd.Env = append(c.cmd.Env,
		envRole+"="+role,
		envWork+"="+work.String(),
		envConcurrency+"="+strconv.Itoa(concurrency))
	c.cmd.ExtraFiles = []*os.File{w}
	c.cmd.Stderr = c.stderr
	if err := c.cmd.Start(); err != nil {
		r.Close()
		w.Close()
		tb.Fatalf("starting %s: %v", role, err)
	}
	// The child holds the write end now; with ours closed, the pipe ends
	// when the child does.
	w.Close()
	go func() {
		defer r.Close()
		defer close(c.lines)
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
	}()
	tb.Cleanup(func() {
		c.kill()
		c.wait()
		for range c.lines {
		}
	})
	return c
}

// kill sends SIGKILL.
func (c *child) kill() { _ = c.cmd.Process.Signal(syscall.SIGKILL) }

// stop sends SIGTERM, on which a child drains and exits.
func (c *child) stop() { _ = c.cmd.Process.Signal(syscall.SIGTERM) }

// wait waits for the process to end and returns how it did.
func (c *child) wait() error {
	c.waitOnce.Do(func() { c.waitErr = c.cmd.Wait() })
	return c.waitErr
}

// headBuffer keeps the first 64 KiB written to it: a child's stderr, whose
// start holds the cause of a failure.
type headBuffer struct {
	mu  sync.Mutex
	buf []byte
}

func (b *headBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if room := 64<<10 - len(b.buf); room > 0 {
		b.buf = append(b.buf, p[:min(len(p), room)]...)
	}
	return len(p), nil
}

func (b *headBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}
