package jetstream

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/custody-go/custody/internal/testkit/testbroker"
)

// patience bounds waits for things that should happen; tests poll rather
// than assume a speed.
const patience = 60 * time.Second

// natsURL is the JetStream server the tests use: NATS_URL, or the one the
// development and CI machines run.
func natsURL() string { return testbroker.Addr("NATS_URL", "nats://127.0.0.1:4222") }

// env is one test's connection to the server.
type env struct {
	t  testing.TB
	nc *nats.Conn
	js jetstream.JetStream
}

// newEnv connects to the shared server, skipping (or failing, where
// brokers are required) when it is not there.
func newEnv(t testing.TB) *env {
	t.Helper()
	return connect(t, natsURL())
}

func connect(t testing.TB, url string, opts ...nats.Option) *env {
	t.Helper()
	testbroker.Dial(t, "NATS JetStream", strings.TrimPrefix(url, "nats://"))
	nc, err := nats.Connect(url, append([]nats.Option{nats.Name(t.Name())}, opts...)...)
	if err != nil {
		testbroker.Unavailable(t, "NATS JetStream at "+url, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return &env{t: t, nc: nc, js: js}
}

func (e *env) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	e.t.Cleanup(cancel)
	return ctx
}

// uniqueName returns a stream name no other test (or helper) uses.
func uniqueName(t testing.TB) string {
	var b [6]byte
	rand.Read(b[:])
	n := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' {
			return r
		}
		return '_'
	}, t.Name())
	if len(n) > 40 {
		n = n[len(n)-40:]
	}
	return "custody_" + n + "_" + hex.EncodeToString(b[:])
}

// stream creates a stream capturing name.> (memory storage unless file),
// deleted when the test ends.
func (e *env) stream(name string, file bool) {
	e.t.Helper()
	storage := jetstream.MemoryStorage
	if file {
		storage = jetstream.FileStorage
	}
	if _, err := e.js.CreateStream(e.ctx(), jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}, Storage: storage}); err != nil {
		e.t.Fatalf("CreateStream %s: %v", name, err)
	}
	e.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		e.js.DeleteStream(ctx, name)
	})
}

// publish puts a message on subject and waits for the stream's PubAck.
func (e *env) publish(subject string, body []byte, headers map[string]string) {
	e.t.Helper()
	m := &nats.Msg{Subject: subject, Data: body}
	if len(headers) > 0 {
		m.Header = nats.Header{}
		for k, v := range headers {
			m.Header.Set(k, v)
		}
	}
	if _, err := e.js.PublishMsg(e.ctx(), m); err != nil {
		e.t.Fatalf("publish to %s: %v", subject, err)
	}
}

// readAll returns every message of stream on subject filter (all, when
// empty), reading with an ordered consumer of its own.
func (e *env) readAll(ctx context.Context, stream, filter string) ([]jetstream.Msg, error) {
	cfg := jetstream.OrderedConsumerConfig{}
	if filter != "" {
		cfg.FilterSubjects = []string{filter}
	}
	info, err := e.js.Stream(ctx, stream)
	if err != nil {
		return nil, err
	}
	total := info.CachedInfo().State.Msgs
	if total == 0 {
		return nil, nil
	}
	c, err := e.js.OrderedConsumer(ctx, stream, cfg)
	if err != nil {
		return nil, err
	}
	var out []jetstream.Msg
	for {
		b, err := c.Fetch(100, jetstream.FetchMaxWait(200*time.Millisecond))
		if err != nil {
			return out, err
		}
		n := 0
		for m := range b.Messages() {
			out = append(out, m)
			n++
		}
		if n == 0 || b.Error() != nil {
			return out, nil
		}
	}
}

// copyHeaders reads a dead-letter copy's headers as a user who knows its
// conventions would: custody-original-headers holds the original headers
// that could not travel as they were.
func copyHeaders(m jetstream.Msg) (map[string]string, error) {
	h := map[string]string{}
	for k, v := range m.Headers() {
		if k == "Nats-Msg-Id" || k == HeaderOriginalHeaders {
			continue
		}
		h[k] = v[0]
	}
	if raw := m.Headers().Get(HeaderOriginalHeaders); raw != "" {
		var kept map[string]string
		if err := json.Unmarshal([]byte(raw), &kept); err != nil {
			return nil, err
		}
		for k, v := range kept {
			h[k] = v
		}
	}
	return h, nil
}

func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(patience)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", patience, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
