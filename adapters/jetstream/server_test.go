package jetstream

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/custody-go/custody/internal/testkit/testbroker"
)

// testServer is a nats-server of a test's own, for tests that stop and
// restart the server: the nats-server binary (PATH, or /usr/sbin), with
// JetStream storing in a directory of the test's, on a free port.
type testServer struct {
	t    testing.TB
	bin  string
	dir  string
	port int
	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

func startServer(t testing.TB) *testServer {
	t.Helper()
	bin, err := exec.LookPath("nats-server")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/nats-server"); serr != nil {
			testbroker.Unavailable(t, "the nats-server binary (for a server of the test's own)", err)
		}
		bin = "/usr/sbin/nats-server"
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	s := &testServer{t: t, bin: bin, dir: t.TempDir(), port: port}
	s.start()
	t.Cleanup(s.stop)
	return s
}

func (s *testServer) url() string { return fmt.Sprintf("nats://127.0.0.1:%d", s.port) }

func (s *testServer) start() {
	s.t.Helper()
	cmd := exec.Command(s.bin, "-a", "127.0.0.1", "-p", fmt.Sprint(s.port), "-js", "-sd", s.dir)
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if err := cmd.Start(); err != nil {
		s.t.Fatalf("starting %s: %v", s.bin, err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	s.mu.Lock()
	s.cmd, s.done = cmd, done
	s.mu.Unlock()
	deadline := time.Now().Add(patience)
	for {
		c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", s.port), time.Second)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("nats-server on port %d did not start: %v", s.port, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// stop ends the server (SIGTERM, as an orderly restart does) and waits for
// it to exit.
func (s *testServer) stop() {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.cmd = nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		cmd.Process.Kill()
		<-done
	}
}

func (s *testServer) restart() {
	s.stop()
	s.start()
}

// proxy forwards TCP connections to a server; cut closes the ones open, as
// a network fault or a killed connection does.
type proxy struct {
	l      net.Listener
	target string
	onPub  func(subject string, payload []byte)
	mu     sync.Mutex
	conns  []net.Conn
	refuse bool // refuse new connections
	wg     sync.WaitGroup
}

func newProxy(t testing.TB, target string) *proxy { return newWatchingProxy(t, target, nil) }

// newWatchingProxy is newProxy calling onPub with every message a client
// publishes.
func newWatchingProxy(t testing.TB, target string, onPub func(subject string, payload []byte)) *proxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{l: l, target: target, onPub: onPub}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *proxy) url() string { return "nats://" + p.l.Addr().String() }

func (p *proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		refuse := p.refuse
		p.mu.Unlock()
		if refuse {
			c.Close()
			continue
		}
		u, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, u)
		p.mu.Unlock()
		p.wg.Add(2)
		go func() {
			defer p.wg.Done()
			defer u.Close()
			if p.onPub == nil {
				io.Copy(u, c)
				return
			}
			// What the client sends is parsed on the way, after it was
			// forwarded: a publish is seen no earlier than the server may
			// act on it.
			pr, pw := io.Pipe()
			parsed := make(chan struct{})
			go func() { defer close(parsed); parseClient(bufio.NewReader(pr), p.onPub); io.Copy(io.Discard, pr) }()
			io.Copy(io.MultiWriter(u, pw), c)
			pw.Close()
			<-parsed
		}()
		go func() { defer p.wg.Done(); io.Copy(c, u); c.Close() }()
	}
}

// cut closes every connection open through the proxy.
func (p *proxy) cut() {
	p.mu.Lock()
	conns := p.conns
	p.conns = nil
	p.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
}

// outage cuts every connection and refuses new ones for d.
func (p *proxy) outage(d time.Duration) {
	end := p.down()
	time.Sleep(d)
	end()
}

// down cuts every connection and refuses new ones until end is called.
func (p *proxy) down() (end func()) {
	p.mu.Lock()
	p.refuse = true
	p.mu.Unlock()
	p.cut()
	return func() {
		p.mu.Lock()
		p.refuse = false
		p.mu.Unlock()
	}
}

func (p *proxy) close() {
	p.l.Close()
	p.cut()
	p.wg.Wait()
}

// parseClient reads the NATS protocol a client sends and calls onPub with
// the subject and payload of each PUB and HPUB (headers left out), until r
// fails.
func parseClient(r *bufio.Reader, onPub func(subject string, payload []byte)) {
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			return
		}
		f := strings.Fields(line)
		if len(f) < 3 {
			continue
		}
		var hdr, total int
		switch strings.ToUpper(f[0]) {
		case "PUB": // PUB <subject> [reply] <size>
			total, err = strconv.Atoi(f[len(f)-1])
		case "HPUB": // HPUB <subject> [reply] <header size> <total size>
			if hdr, err = strconv.Atoi(f[len(f)-2]); err == nil {
				total, err = strconv.Atoi(f[len(f)-1])
			}
		default:
			continue
		}
		if err != nil {
			return
		}
		buf := make([]byte, total+2) // and its CRLF
		if _, err := io.ReadFull(r, buf); err != nil {
			return
		}
		onPub(f[1], buf[hdr:total])
	}
}
