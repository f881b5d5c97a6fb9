package jetstream

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/nats-io/nats.go"
)

// replies sends acknowledgement requests (ack, nak, progress, term) and
// waits for the server's replies, many at once on one subscription: a
// Source's Ack of 256 deliveries publishes 256 requests and waits once,
// without a goroutine or a subscription per request. Each request's reply
// subject is the Source's inbox prefix and a sequence number.
//
// The server answers an acknowledgement only once it has processed it, so a
// reply means the ack, nak or renewal took effect for the message's stream
// sequence (if that sequence was still pending for the consumer: a server
// of version 2.9 replies to an ack of a message already acked as well).
type replies struct {
	nc     *nats.Conn
	prefix string // inbox prefix, with its trailing dot
	sub    *nats.Subscription

	mu      sync.Mutex
	seq     uint64
	waiting map[uint64]waiter
}

// waiter is one request waiting for its reply: entry i of call c.
type waiter struct {
	c *call
	i int
}

// call is a set of requests sent together.
type call struct {
	mu      sync.Mutex
	errs    []error // per request; errPending until answered
	left    int
	done    chan struct{}
	ids     []uint64 // reply ids, to forget those never answered
	settled bool
}

var errPending = errors.New("custody: no reply yet")

func newReplies(nc *nats.Conn) (*replies, error) {
	r := &replies{nc: nc, prefix: nc.NewInbox() + ".", waiting: make(map[uint64]waiter)}
	sub, err := nc.Subscribe(r.prefix+"*", r.onReply)
	if err != nil {
		return nil, fmt.Errorf("subscribing to acknowledgement replies: %w", err)
	}
	// Replies are small and come at the pace of our own requests: never drop
	// one as a slow consumer would.
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		sub.Unsubscribe()
		return nil, err
	}
	r.sub = sub
	return r, nil
}

func (r *replies) close() {
	r.sub.Unsubscribe()
}

func (r *replies) onReply(m *nats.Msg) {
	id, err := strconv.ParseUint(m.Subject[strings.LastIndexByte(m.Subject, '.')+1:], 10, 64)
	if err != nil {
		return
	}
	r.mu.Lock()
	w, ok := r.waiting[id]
	delete(r.waiting, id)
	r.mu.Unlock()
	if !ok {
		return // answered after its call gave up
	}
	var result error
	if status := m.Header.Get("Status"); status != "" {
		// 503: nothing listens on the ack subject (the consumer was
		// deleted, or its stream is unavailable).
		result = fmt.Errorf("the server answered %s %s", status, m.Header.Get("Description"))
		if status == "503" {
			result = fmt.Errorf("%w (no responders: is the consumer gone?)", result)
		}
	}
	w.c.answer(w.i, result)
}

// answer records the result of request i, unless the call has given up.
func (c *call) answer(i int, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.settled && c.errs[i] == errPending {
		c.errs[i] = err
		if c.left--; c.left == 0 {
			close(c.done)
		}
	}
}

// request is one acknowledgement to send: body to subject (a delivery's
// reply subject). skip, when non-nil, fails the entry without sending it.
type request struct {
	subject string
	body    []byte
	skip    error
}

// send publishes every request not skipped and waits for their replies
// until ctx ends. It returns one error per request: nil for a request the
// server answered, the skip error, the publish error, or one wrapping ctx's
// error for a request not answered in time (it may still have taken
// effect).
func (r *replies) send(ctx context.Context, reqs []request) []error {
	c := &call{errs: make([]error, len(reqs)), done: make(chan struct{}), ids: make([]uint64, 0, len(reqs))}
	r.mu.Lock()
	for i := range reqs {
		if reqs[i].skip != nil {
			c.errs[i] = reqs[i].skip
			continue
		}
		c.errs[i] = errPending
		c.left++
		r.seq++
		r.waiting[r.seq] = waiter{c: c, i: i}
		c.ids = append(c.ids, r.seq)
	}
	r.mu.Unlock()
	if c.left == 0 {
		return c.errs
	}
	var buf []byte
	failed, k := false, 0
	for i := range reqs {
		if reqs[i].skip != nil {
			continue
		}
		buf = strconv.AppendUint(append(buf[:0], r.prefix...), c.ids[k], 10)
		k++
		if err := r.nc.PublishRequest(reqs[i].subject, string(buf), reqs[i].body); err != nil {
			failed = true
			c.answer(i, err)
		}
	}
	select {
	case <-c.done:
		if !failed {
			return c.errs // every reply arrived, and onReply forgot its id
		}
	case <-ctx.Done():
	}
	r.mu.Lock()
	for _, id := range c.ids {
		delete(r.waiting, id)
	}
	r.mu.Unlock()
	c.mu.Lock()
	c.settled = true
	for i, err := range c.errs {
		if err == errPending {
			c.errs[i] = fmt.Errorf("no reply from the server before %w (the request may still have taken effect)", context.Cause(ctx))
		}
	}
	c.mu.Unlock()
	return c.errs
}

// publish sends the requests not skipped without asking for replies (the
// fire-and-forget form) and returns one error per request: the skip error
// or the publish error.
func (r *replies) publish(reqs []request) []error {
	errs := make([]error, len(reqs))
	for i := range reqs {
		if errs[i] = reqs[i].skip; errs[i] == nil {
			errs[i] = r.nc.Publish(reqs[i].subject, reqs[i].body)
		}
	}
	return errs
}
