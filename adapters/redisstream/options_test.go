package redisstream

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestInvalidOptions checks that New refuses bad configuration with an error
// naming the option, before it touches the server.
func TestInvalidOptions(t *testing.T) {
	cases := []struct {
		opt  Option
		name string
	}{
		{WithConsumer(""), "WithConsumer"},
		{WithCreateGroup(""), "WithCreateGroup"},
		{WithCreateGroup("latest"), "WithCreateGroup"},
		{WithLease(time.Millisecond), "WithLease"},
		{WithLease(10500 * time.Microsecond), "WithLease"},
		{WithLease(25 * time.Hour), "WithLease"},
		{WithBlock(0), "WithBlock"},
		{WithBlock(2 * time.Minute), "WithBlock"},
		{WithReclaimInterval(0), "WithReclaimInterval"},
		{WithBodyField(""), "WithBodyField"},
		{WithConsumerCleanup(-time.Second), "WithConsumerCleanup"},
		{WithMeterProvider(nil), "WithMeterProvider"},
		{WithLogger(nil), "WithLogger"},
	}
	c := newClient(t, redisAddr())
	for _, tc := range cases {
		_, err := New(context.Background(), c, "custody-test:no-such-stream", "g", tc.opt)
		if err == nil || !strings.Contains(err.Error(), tc.name) {
			t.Errorf("%s: New returned %v, want an error naming the option", tc.name, err)
		}
	}
	if _, err := New(context.Background(), c, "custody-test:no-such-stream", "g", WithLease(time.Second), WithReclaimInterval(2*time.Second)); err == nil || !strings.Contains(err.Error(), "WithReclaimInterval") {
		t.Errorf("a reclaim interval longer than the lease: %v, want an error naming WithReclaimInterval", err)
	}
	if _, err := New(context.Background(), nil, "s", "g"); err == nil {
		t.Error("New with a nil client returned no error")
	}
	if _, err := New(context.Background(), c, "", "g"); err == nil {
		t.Error("New without a stream returned no error")
	}
}

// TestNewChecksTheGroup: without WithCreateGroup, a missing group fails New
// with an error saying how to create it; with it, New creates the group (and
// the stream).
func TestNewChecksTheGroup(t *testing.T) {
	e := newEnv(t)
	_, err := New(e.ctx(), e.client, e.stream, e.group)
	if err == nil || !strings.Contains(err.Error(), "WithCreateGroup") {
		t.Fatalf("New on a missing group: %v, want an error naming WithCreateGroup", err)
	}
	src, err := New(e.ctx(), e.client, e.stream, e.group, WithCreateGroup("$"), WithLogger(quiet()))
	if err != nil {
		t.Fatal(err)
	}
	src.Close()
	if _, err := New(e.ctx(), e.client, e.stream, e.group, WithLogger(quiet())); err != nil {
		t.Fatalf("New on the group it created: %v", err)
	}
}

func TestDelaysKeySharesTheStreamsSlot(t *testing.T) {
	for _, tc := range []struct {
		stream string
		ok     bool
	}{
		{"orders", true}, {"{o}orders", true}, {"a{b", true}, {"a}b", false}, {"{}x", false},
	} {
		k, ok := delaysKey(tc.stream, "g")
		if ok != tc.ok || (ok && hashTag(k) != hashTag(tc.stream)) {
			t.Errorf("delaysKey(%q) = %q, %t: tags %q and %q", tc.stream, k, ok, hashTag(k), hashTag(tc.stream))
		}
	}
}
