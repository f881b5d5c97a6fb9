package sqsemu

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/internal/testkit/testbroker"
)

// startTimeout bounds how long the emulator may take to print its address
// and answer a first request (node starts in well under a second; the margin
// is for a loaded CI machine).
const startTimeout = time.Minute

// Emulator is one running emulator process.
type Emulator struct {
	// Endpoint is the emulator's base URL, for example http://127.0.0.1:40123.
	Endpoint string

	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stderr *lockedBuffer
	exited chan struct{}
}

// Launch installs the emulator when needed, starts it on a free loopback
// port and waits until it answers HTTP. Close stops it.
func Launch(ctx context.Context) (*Emulator, error) {
	node, err := exec.LookPath("node")
	if err != nil {
		return nil, fmt.Errorf("node is not on the PATH: %w", err)
	}
	dir, err := findDir()
	if err != nil {
		return nil, err
	}
	if err := ensureInstalled(ctx, dir); err != nil {
		return nil, err
	}

	cmd := exec.Command(node, filepath.Join(dir, "server.js"), "0")
	cmd.Dir = dir
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	e := &Emulator{cmd: cmd, stdin: stdin, stderr: &lockedBuffer{}, exited: make(chan struct{})}
	cmd.Stderr = e.stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		cmd.Wait()
		close(e.exited)
	}()

	endpoint := make(chan string, 1)
	go func() {
		// Read the address line, then keep draining stdout so the emulator
		// never blocks on a full pipe. Ends when the process exits.
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if addr, ok := strings.CutPrefix(sc.Text(), "listening "); ok {
				select {
				case endpoint <- addr:
				default:
				}
			}
		}
	}()

	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	select {
	case e.Endpoint = <-endpoint:
	case <-e.exited:
		return nil, fmt.Errorf("sqs emulator exited before listening: %s", e.stderr.String())
	case <-ctx.Done():
		e.Close()
		return nil, fmt.Errorf("sqs emulator did not start within %v: %w; stderr: %s", startTimeout, ctx.Err(), e.stderr.String())
	}
	if err := waitAnswering(ctx, e.Endpoint); err != nil {
		e.Close()
		return nil, err
	}
	return e, nil
}

// waitAnswering polls the endpoint until any HTTP response comes back.
func waitAnswering(ctx context.Context, endpoint string) error {
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, endpoint+"/", nil)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("sqs emulator at %s does not answer: %w", endpoint, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Close stops the emulator: it closes its standard input (the emulator exits
// on that) and kills it if it has not exited within five seconds.
func (e *Emulator) Close() error {
	e.stdin.Close()
	select {
	case <-e.exited:
	case <-time.After(5 * time.Second):
		e.cmd.Process.Kill()
		<-e.exited
	}
	return nil
}

var shared struct {
	once sync.Once
	mu   sync.Mutex
	emu  *Emulator
	err  error
}

// Start returns the endpoint of the emulator shared by this test binary,
// starting it on first use. It calls testbroker.Unavailable (skip, or fail in
// CI) when the emulator cannot run here. See [Run] for stopping it.
func Start(t testing.TB) string {
	t.Helper()
	shared.once.Do(func() {
		emu, err := Launch(context.Background())
		shared.mu.Lock()
		shared.emu, shared.err = emu, err
		shared.mu.Unlock()
	})
	shared.mu.Lock()
	emu, err := shared.emu, shared.err
	shared.mu.Unlock()
	if err != nil {
		testbroker.Unavailable(t, "SQS emulator (npm local-aws-sqs)", err)
		return ""
	}
	if emu == nil {
		testbroker.Unavailable(t, "SQS emulator (npm local-aws-sqs)", errors.New("already stopped"))
		return ""
	}
	return emu.Endpoint
}

// Run runs the tests and then stops the shared emulator, if one was started.
// Call it from TestMain: os.Exit(sqsemu.Run(m)).
func Run(m *testing.M) int {
	code := m.Run()
	Stop()
	return code
}

// Stop stops the shared emulator, if one was started. A TestMain that checks
// for leaked goroutines does so before calling Stop: with the emulator gone,
// a client call still in flight would fail and end, hiding the leak.
func Stop() {
	shared.mu.Lock()
	emu := shared.emu
	shared.emu = nil
	shared.mu.Unlock()
	if emu != nil {
		emu.Close()
	}
}

type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.buf.Len() > 64<<10 {
		return len(p), nil // keep the start of the output; it holds the cause
	}
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
