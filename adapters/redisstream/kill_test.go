package redisstream

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/consumer"
)

// childEnv carries, to a child process of the test binary, what it
// consumes: "addr stream group lease".
const childEnv = "CUSTODY_REDISSTREAM_CHILD"

// runChild is a consumer process: it consumes the stream named in childEnv
// with a handler that takes a few milliseconds and writes "handled ID"
// to its standard output once the effect is done (before the runtime acks),
// until it is killed.
func runChild() int {
	var addr, stream, group string
	var leaseMS int64
	if _, err := fmt.Sscan(os.Getenv(childEnv), &addr, &stream, &group, &leaseMS); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	src, err := New(ctx, rdb, stream, group, WithLease(time.Duration(leaseMS)*time.Millisecond), WithBlock(50*time.Millisecond), WithLogger(quiet()))
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	var mu sync.Mutex
	out := bufio.NewWriter(os.Stdout)
	fmt.Fprintln(out, "consumer", src.Consumer())
	out.Flush()
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		time.Sleep(5 * time.Millisecond)
		mu.Lock()
		fmt.Fprintln(out, "handled", m.ID)
		out.Flush()
		mu.Unlock()
		return nil
	}), consumer.WithConcurrency(8), consumer.WithMaxInFlight(40), consumer.WithLogger(quiet()))
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	if err := c.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	return 0
}

// TestKilledConsumerIsReclaimed runs two consumers on one stream, one of
// them in a child process that is killed (SIGKILL: no drain, no ack, no
// give-back) while it holds entries. Everything it held must be reclaimed by
// the other once idle for the lease, and handled there with the group's
// delivery count as its attempt: no entry is lost.
func TestKilledConsumerIsReclaimed(t *testing.T) {
	const n = 400
	const lease = time.Second
	e := newEnv(t)
	bodies := make([]string, n)
	for i := range bodies {
		bodies[i] = fmt.Sprintf("m%03d", i)
	}
	ids := e.publish(bodies...)
	// The group exists before either consumer starts, from the first entry.
	if err := e.client.XGroupCreate(e.ctx(), e.stream, e.group, "0").Err(); err != nil {
		t.Fatal(err)
	}

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s %s %s %d", childEnv, redisAddr(), e.stream, e.group, lease.Milliseconds()))
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var (
		mu           sync.Mutex
		childName    string
		childHandled = map[string]bool{}
		started      = make(chan struct{})
		readDone     = make(chan struct{})
	)
	go func() {
		defer close(readDone)
		sc := bufio.NewScanner(stdout)
		once := sync.Once{}
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			if len(f) != 2 {
				continue
			}
			mu.Lock()
			switch f[0] {
			case "consumer":
				childName = f[1]
			case "handled":
				childHandled[f[1]] = true
				if len(childHandled) >= 40 {
					once.Do(func() { close(started) })
				}
			}
			mu.Unlock()
		}
		io.Copy(io.Discard, stdout)
	}()

	// The surviving consumer, in this process, from the start.
	var (
		hmu      sync.Mutex
		handled  = map[string][]int{} // id -> attempts
		finished = make(chan struct{})
		once     sync.Once
	)
	src := e.open(WithLease(lease), WithReclaimInterval(100*time.Millisecond))
	s := start(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		time.Sleep(5 * time.Millisecond)
		hmu.Lock()
		handled[m.ID] = append(handled[m.ID], m.Attempt)
		hmu.Unlock()
		return nil
	}), consumer.WithConcurrency(4), consumer.WithMaxInFlight(8))

	select {
	case <-started:
	case <-readDone:
		t.Fatal("the child consumer exited before it handled 40 entries")
	case <-time.After(time.Minute):
		t.Fatal("the child consumer did not start handling within a minute")
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	<-readDone
	mu.Lock()
	name := childName
	mu.Unlock()
	var held []string
	for _, p := range e.pending() {
		if p.Consumer == name {
			held = append(held, p.ID)
		}
	}
	if len(held) == 0 {
		t.Fatalf("the child consumer %q held nothing when it was killed; the test proves nothing", name)
	}
	t.Logf("the child %s was killed holding %d entries (%d handled by it)", name, len(held), len(childHandled))

	// Done once every entry was handled by one or the other and nothing is
	// pending any more.
	go func() {
		for {
			hmu.Lock()
			done := true
			for _, id := range ids {
				if len(handled[id]) == 0 && !childHandled[id] {
					done = false
					break
				}
			}
			hmu.Unlock()
			if done && len(e.pending()) == 0 {
				once.Do(func() { close(finished) })
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	select {
	case <-finished:
	case <-time.After(2 * time.Minute):
		t.Fatalf("not every entry was handled within two minutes: %d pending", len(e.pending()))
	}
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	hmu.Lock()
	defer hmu.Unlock()
	for _, id := range held {
		got := handled[id]
		if len(got) == 0 {
			t.Errorf("entry %s, held by the killed consumer, was never handled by the survivor", id)
			continue
		}
		if got[0] < 2 {
			t.Errorf("entry %s, held by the killed consumer, came back with attempt %d, want >= 2 (the group's delivery count)", id, got[0])
		}
	}
	st := src.Stats()
	if st.Reclaimed < int64(len(held)) {
		t.Errorf("Stats.Reclaimed = %d, want at least the %d entries the killed consumer held", st.Reclaimed, len(held))
	}
}
