package redisstream

import (
	"context"
	"errors"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testbroker"
)

// server is a redis-server of a test's own, on a free port with its own
// directory, so that killing and restarting it disturbs no one else using
// the shared Redis.
type server struct {
	t    testing.TB
	addr string
	args []string
	bin  string
	mu   sync.Mutex
	cmd  *exec.Cmd
}

// startServer starts redis-server, with an append-only file synced on every
// write when persist is set, with no persistence at all otherwise. A
// machine without the binary skips the test (fails it when brokers are
// required).
func startServer(t testing.TB, persist bool) *server {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		testbroker.Unavailable(t, "the redis-server binary", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	dir := t.TempDir()
	aof := "no"
	if persist {
		aof = "yes"
	}
	s := &server{t: t, bin: bin, addr: "127.0.0.1:" + strconv.Itoa(port), args: []string{
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", dir,
		"--save", "", "--appendonly", aof, "--appendfsync", "always",
		"--daemonize", "no", "--logfile", filepath.Join(dir, "redis.log"),
	}}
	s.start()
	t.Cleanup(s.kill)
	return s
}

func (s *server) start() {
	s.t.Helper()
	cmd := exec.Command(s.bin, s.args...)
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	s.mu.Lock()
	s.cmd = cmd
	s.mu.Unlock()
	c := redis.NewClient(&redis.Options{Addr: s.addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(30 * time.Second)
	for c.Ping(context.Background()).Err() != nil {
		if time.Now().After(deadline) {
			s.t.Fatalf("redis-server on %s did not answer within 30s", s.addr)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// kill stops the server as a crash would (SIGKILL).
func (s *server) kill() {
	s.mu.Lock()
	cmd := s.cmd
	s.cmd = nil
	s.mu.Unlock()
	if cmd != nil {
		cmd.Process.Kill()
		cmd.Wait()
	}
}

// restartScenario runs a consumer on a server of its own, kills the server
// while the consumer holds two entries (handlers still running) and one
// retry waits in the pending list, restarts it, and writes new entries. It
// returns the Source and what became of each entry.
type restartOutcome struct {
	src      *Source
	handled  map[string]int   // successful handler calls by body
	causes   map[string]error // how the held handlers ended
	attempts map[string][]int
}

func restartScenario(t *testing.T, persist bool) restartOutcome {
	srv := startServer(t, persist)
	c := newClient(t, srv.addr)
	e := newEnvOn(t, c)
	// A lease far longer than a restart takes: the renewals that fail
	// while the server is down are tried again before it runs out.
	const lease = 5 * time.Second
	e.publish("ok0", "ok1", "ok2", "held0", "held1", "retry")
	var (
		mu      sync.Mutex
		release = make(chan struct{})
		out     = restartOutcome{handled: map[string]int{}, causes: map[string]error{}, attempts: map[string][]int{}}
	)
	src := e.open(WithLease(lease), WithReclaimInterval(50*time.Millisecond))
	out.src = src
	s := start(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		b := string(m.Body)
		mu.Lock()
		out.attempts[b] = append(out.attempts[b], m.Attempt)
		mu.Unlock()
		switch {
		case b == "retry" && m.Attempt == 1:
			return consumer.RetryAfter(errors.New("later"), time.Second)
		case b == "held0" || b == "held1":
			var err error
			select {
			case <-release:
			case <-ctx.Done():
				err = context.Cause(ctx)
			}
			mu.Lock()
			out.causes[b] = err
			mu.Unlock()
			if err != nil {
				return err
			}
		}
		mu.Lock()
		out.handled[b]++
		mu.Unlock()
		return nil
	}), consumer.WithConcurrency(4), consumer.WithRetry(consumer.Retry{MaxAttempts: 5}))
	waitFor(t, "the ok entries handled, two held and the retry waiting", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return out.handled["ok0"]+out.handled["ok1"]+out.handled["ok2"] == 3 &&
			len(out.attempts["held0"]) == 1 && len(out.attempts["held1"]) == 1 && len(out.attempts["retry"]) == 1
	})
	srv.kill()
	srv.start()
	e.publish("new0", "new1", "new2")
	waitFor(t, "the new entries handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return out.handled["new0"] == 1 && out.handled["new1"] == 1 && out.handled["new2"] == 1
	})
	if persist {
		waitFor(t, "the retry handled", func() bool { mu.Lock(); defer mu.Unlock(); return out.handled["retry"] == 1 })
		close(release)
		waitFor(t, "nothing pending", func() bool { return len(e.pending()) == 0 })
	} else {
		waitFor(t, "the held handlers cancelled", func() bool { mu.Lock(); defer mu.Unlock(); return len(out.causes) == 2 })
		close(release)
		waitFor(t, "nothing pending", func() bool { return len(e.pending()) == 0 })
	}
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	return out
}

// TestServerRestartWithoutPersistence kills the server, which keeps nothing
// on disk, while the consumer holds two entries and a retry waits: the
// stream, the group, the held entries and the waiting retry are gone. The
// Source must say so (the held handlers are cancelled with their lease
// lost, the missing group is counted) and go on with what is written
// afterwards.
func TestServerRestartWithoutPersistence(t *testing.T) {
	out := restartScenario(t, false)
	for _, b := range []string{"held0", "held1"} {
		if !errors.Is(out.causes[b], adapters.ErrLeaseLost) || !errors.Is(out.causes[b], ErrGroupMissing) {
			t.Errorf("held entry %s: its handler ended with %v, want a cause wrapping adapters.ErrLeaseLost and ErrGroupMissing", b, out.causes[b])
		}
	}
	if out.handled["retry"] != 0 {
		t.Errorf("the waiting retry came back after the server lost it")
	}
	st := out.src.Stats()
	if st.GroupMissing == 0 {
		t.Error("Stats.GroupMissing = 0: the lost group was not reported")
	}
	t.Logf("lost with the server's data: the 2 held entries (handlers cancelled: %v) and the waiting retry; reported: GroupMissing=%d LeaseLost=%d",
		out.causes["held0"], st.GroupMissing, st.LeaseLost)
}

// TestServerRestartWithPersistence kills a server that syncs its
// append-only file on every write: nothing is lost. The held handlers run
// on (their renewals go through once the server is back) and are acked, the
// waiting retry comes back as attempt 2, and the new entries are handled.
func TestServerRestartWithPersistence(t *testing.T) {
	out := restartScenario(t, true)
	for _, b := range []string{"held0", "held1"} {
		if out.causes[b] != nil || out.handled[b] != 1 {
			t.Errorf("held entry %s: handled %d times, handler ended with %v; want once, its context alive", b, out.handled[b], out.causes[b])
		}
	}
	if got := out.attempts["retry"]; len(got) != 2 || got[1] != 2 {
		t.Errorf("the retry's attempts %v, want [1 2]", got)
	}
	if st := out.src.Stats(); st.GroupMissing != 0 {
		t.Errorf("Stats.GroupMissing = %d, want 0: the group survived", st.GroupMissing)
	}
}
