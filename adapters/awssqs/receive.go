package awssqs

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
)

// systemAttributes are the system attributes every receive asks for. They
// are asked through both AttributeNames (deprecated, but the only field some
// emulators read) and MessageSystemAttributeNames (what SQS documents now).
var systemAttributes = []string{
	string(types.MessageSystemAttributeNameApproximateReceiveCount),
	string(types.MessageSystemAttributeNameApproximateFirstReceiveTimestamp),
	string(types.MessageSystemAttributeNameSentTimestamp),
	string(types.MessageSystemAttributeNameMessageGroupId),
	string(types.MessageSystemAttributeNameMessageDeduplicationId),
	string(types.MessageSystemAttributeNameSequenceNumber),
	// The X-Ray trace header the message was sent with, which a
	// DeadLetterQueue copy keeps.
	string(types.MessageSystemAttributeNameAWSTraceHeader),
}

// Receive returns up to max messages. It keeps up to one ReceiveMessage call
// in flight per ten messages of room (see WithPollers) and returns as soon as
// one of them brings messages; the others keep running and their messages
// wait in the Source for the next Receive. Polls never ask for more than the
// room max leaves, but the runtime may ask again only later (it fetches in
// batches), so the Source renews the visibility of messages that wait for it
// (see keepBuffered).
//
// It returns an empty result and a nil error when a poll finds the queue
// empty, ctx's error when ctx is done, and adapters.ErrClosed after Close.
func (s *Source) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	if max <= 0 {
		return nil, nil
	}
	s.mu.Lock()
	startGen := s.emptyGen
	for {
		if s.closed {
			s.mu.Unlock()
			return nil, adapters.ErrClosed
		}
		if err := ctx.Err(); err != nil {
			// Shutting down: what is buffered stays for Close to release.
			s.mu.Unlock()
			return nil, err
		}
		if len(s.buf) > 0 {
			if wait := s.bufRenewing; wait != nil {
				// A renewal of buffered messages is on the wire. Handed out
				// now, a message could be acked or nacked before it lands:
				// SQS would then hide a nacked message for a whole timeout
				// again, overriding the nack's delay, and refuse the renewal
				// of a deleted one, which would mark it lost. Wait for it, as
				// the lease keeper's Stop does.
				changed := s.changed
				s.mu.Unlock()
				select {
				case <-wait:
				case <-changed:
				case <-ctx.Done():
				}
				s.mu.Lock()
				continue
			}
			n := min(max, len(s.buf))
			ds := make([]*adapters.Delivery, n)
			copy(ds, s.buf)
			for i, d := range ds {
				if since := s.bufSince[i]; since.After(d.ReceivedAt) {
					// Renewed while it waited: the runtime's lease
					// keeper counts its visibility from there.
					d.LeasedAt = since
				}
			}
			s.buf = append(s.buf[:0], s.buf[n:]...)
			s.bufSince = append(s.bufSince[:0], s.bufSince[n:]...)
			s.mu.Unlock()
			return ds, nil
		}
		if err := s.pollErr; err != nil {
			s.pollErr = nil
			s.mu.Unlock()
			return nil, err
		}
		if s.emptyGen != startGen {
			s.mu.Unlock()
			return nil, nil
		}
		s.startPollsLocked(max)
		changed := s.changed
		s.mu.Unlock()
		select {
		case <-changed:
		case <-ctx.Done():
		}
		s.mu.Lock()
	}
}

// startPollsLocked starts polls until the room max leaves is covered or the
// poller limit is reached.
func (s *Source) startPollsLocked(max int) {
	limit := s.pollers
	room := max - len(s.buf) - s.pending
	if !s.renewerStarted && room > 0 {
		// Only polls fill the buffer, so its renewer starts with the first
		// one rather than in New: the runtime closes only a Source it runs,
		// and one never run (its consumer failed to build) must leave no
		// goroutine behind.
		s.renewerStarted = true
		s.polls.Add(1)
		go s.keepBuffered()
	}
	for s.inflight < limit && room > 0 {
		n := min(room, s.opts.maxMessages)
		room -= n
		s.inflight++
		s.pending += n
		s.polls.Add(1)
		go s.poll(n)
	}
}

func (s *Source) broadcastLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// poll makes one ReceiveMessage call for up to n messages and files the
// result for Receive.
func (s *Source) poll(n int) {
	defer s.polls.Done()
	in := &sqs.ReceiveMessageInput{
		QueueUrl:                    aws.String(s.url),
		MaxNumberOfMessages:         int32(n),
		WaitTimeSeconds:             int32(s.opts.waitTime / time.Second),
		MessageAttributeNames:       s.opts.attributeNames,
		AttributeNames:              make([]types.QueueAttributeName, len(systemAttributes)),
		MessageSystemAttributeNames: make([]types.MessageSystemAttributeName, len(systemAttributes)),
	}
	for i, a := range systemAttributes {
		in.AttributeNames[i] = types.QueueAttributeName(a)
		in.MessageSystemAttributeNames[i] = types.MessageSystemAttributeName(a)
	}
	if s.opts.visibility > 0 {
		in.VisibilityTimeout = int32(s.opts.visibility / time.Second)
	}
	if s.fifo {
		// The SDK retries a call whose answer was lost with this same
		// input. Without an attempt id SQS picks afresh, and the messages
		// of the lost answer sit invisible for a whole visibility timeout,
		// handed to no one, blocking their groups; with one, SQS returns
		// them again. (FIFO queues only; random, since SQS matches ids
		// across all the queue's consumers.)
		in.ReceiveRequestAttemptId = aws.String(rand.Text())
	}
	s.stats.receives.Add(1)
	asked := time.Now()
	// Bounded by the long poll's wait and the request timeout: a poll whose
	// connection hangs would otherwise hold this poller's slot for ever, and
	// a FIFO queue has only one.
	rctx, cancel := context.WithTimeout(s.pollCtx, s.opts.waitTime+s.opts.requestTimeout)
	out, err := s.client.ReceiveMessage(rctx, in)
	cancel()
	now := time.Now()
	var ds []*adapters.Delivery
	if err == nil {
		ds = make([]*adapters.Delivery, 0, len(out.Messages))
		for _, m := range out.Messages {
			d := s.delivery(m, now)
			d.Handle.(*handle).asked = asked
			ds = append(ds, d)
		}
		s.stats.received.Add(int64(len(ds)))
		if len(ds) == 0 {
			s.stats.emptyReceives.Add(1)
			if s.opts.waitTime == 0 {
				// A short poll on an empty queue returns at once; pause so
				// an idle consumer does not spin.
				select {
				case <-time.After(s.opts.emptyPollBackoff):
				case <-s.pollCtx.Done():
				}
			}
		}
	} else if s.pollCtx.Err() != nil {
		err = nil // closing: not a failure
	} else {
		s.stats.receiveErrors.Add(1)
		err = fmt.Errorf("awssqs: ReceiveMessage on %s: %w", s.url, err)
	}

	s.mu.Lock()
	ds, poison := s.filterPoisonLocked(ds)
	s.inflight--
	s.pending -= n
	s.buf = append(s.buf, ds...)
	for range ds {
		s.bufSince = append(s.bufSince, now)
	}
	if err != nil && s.pollErr == nil {
		s.pollErr = err
	}
	if err == nil && len(ds) == 0 {
		s.emptyGen++
	}
	s.broadcastLocked()
	s.mu.Unlock()
	s.releasePoison(poison)
}

// delivery turns a received message into a Delivery.
func (s *Source) delivery(m types.Message, now time.Time) *adapters.Delivery {
	d := &adapters.Delivery{
		ID:         aws.ToString(m.MessageId),
		Body:       []byte(aws.ToString(m.Body)),
		Queue:      s.name,
		Partition:  -1,
		Offset:     -1,
		ReceivedAt: now,
		Native:     m,
	}
	h := &handle{receipt: aws.ToString(m.ReceiptHandle)}
	d.Handle, d.Signal = h, &h.signal
	if len(m.MessageAttributes) > 0 {
		d.Headers = make(map[string]string, len(m.MessageAttributes))
		for k, v := range m.MessageAttributes {
			d.Headers[k] = attributeString(v)
		}
	}
	if n, err := strconv.Atoi(m.Attributes[string(types.MessageSystemAttributeNameApproximateReceiveCount)]); err == nil {
		d.Attempt = n
	}
	d.PublishedAt = millis(m.Attributes[string(types.MessageSystemAttributeNameSentTimestamp)])
	d.FirstReceivedAt = millis(m.Attributes[string(types.MessageSystemAttributeNameApproximateFirstReceiveTimestamp)])
	if g := m.Attributes[string(types.MessageSystemAttributeNameMessageGroupId)]; g != "" {
		d.Key = g
		if s.fifo {
			d.OrderingKey = g
		}
	}
	return d
}

// attributeString renders a message attribute as a header value: String and
// Number attributes as they are, Binary ones in standard base64.
func attributeString(v types.MessageAttributeValue) string {
	if strings.HasPrefix(aws.ToString(v.DataType), "Binary") {
		return base64.StdEncoding.EncodeToString(v.BinaryValue)
	}
	return aws.ToString(v.StringValue)
}

func millis(s string) time.Time {
	ms, err := strconv.ParseInt(s, 10, 64)
	if err != nil || ms <= 0 {
		return time.Time{}
	}
	return time.UnixMilli(ms)
}

// Message returns the SQS message behind m, a handler's *consumer.Message or
// an *adapters.Delivery, with its system attributes (MessageGroupId,
// MessageDeduplicationId, SequenceNumber, ApproximateReceiveCount, ...) and
// message attributes.
func Message(m interface{ As(any) bool }) (types.Message, bool) {
	var msg types.Message
	ok := m.As(&msg)
	return msg, ok
}

// GroupID returns the FIFO message group id of m, a *consumer.Message or an
// *adapters.Delivery ("" on a standard queue). It is also the message's Key.
func GroupID(m interface{ As(any) bool }) string {
	msg, _ := Message(m)
	return msg.Attributes[string(types.MessageSystemAttributeNameMessageGroupId)]
}

// DeduplicationID returns the FIFO deduplication id of m, a
// *consumer.Message or an *adapters.Delivery ("" on a standard queue); SQS
// computes it from the body for queues with content-based deduplication.
func DeduplicationID(m interface{ As(any) bool }) string {
	msg, _ := Message(m)
	return msg.Attributes[string(types.MessageSystemAttributeNameMessageDeduplicationId)]
}

// handle is the Delivery.Handle of a delivery received by a Source.
type handle struct {
	receipt string
	// signal loses a message whose visibility ran out while it waited in
	// the Source's buffer.
	signal adapters.Signal
	// asked is when the ReceiveMessage call that brought the message was
	// made. SQS received the message no earlier, so its 12 hours of
	// invisibility end no later than asked + 12 h; Delivery.ReceivedAt,
	// taken when the answer arrived, can be later than SQS's receive.
	asked time.Time

	// Under Source.mu: renewals of the message on the wire; whether
	// Redrive.Send gave it back, after which it is not renewed; and, while
	// Send waits for those renewals, a channel closed when the last returns.
	renewing   int
	handedBack bool
	renewed    chan struct{}
}

func receipt(d *adapters.Delivery) string {
	switch h := d.Handle.(type) {
	case *handle:
		return h.receipt
	case string:
		return h
	}
	return ""
}

// keepBuffered renews the visibility of messages waiting in the Source's
// buffer, so that none runs out unseen: a poll can bring messages after the
// Receive that started it returned, and the runtime takes them only when it
// next has room for a batch. Every sixth of the timeout it extends, to a full
// timeout, those that have waited a third of it; the runtime's lease keeper
// takes over once Receive hands them out. Receive hands none out while such a
// renewal is on the wire, so that none lands after an ack or a nack. One
// whose renewals fail until its visibility runs out is marked lost. It
// starts with the first poll and ends when Close stops the polls.
func (s *Source) keepBuffered() {
	defer s.polls.Done()
	renewAfter := s.visibility / 3
	every := s.visibility / 6
	// A renewal must be answered this long before the visibility runs out
	// (by this Source's clock, which starts it when the poll's answer
	// arrives, a little after SQS did), as the runtime's lease keeper
	// requires: a twelfth of the timeout.
	margin := s.visibility / 12
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
		case <-s.pollCtx.Done():
			return
		}
		now := time.Now()
		var (
			due     []*adapters.Delivery
			expires []time.Time // when each of due is no longer safely this Source's
		)
		s.mu.Lock()
		for i, d := range s.buf {
			if now.Sub(s.bufSince[i]) >= renewAfter && d.Signal.LostCause() == nil {
				due = append(due, d)
				expires = append(expires, s.bufSince[i].Add(s.visibility-margin))
			}
		}
		if len(due) > 0 {
			s.bufRenewing = make(chan struct{}) // Receive waits for it
		}
		s.mu.Unlock()
		if len(due) == 0 {
			continue
		}
		// A failed entry whose receipt expired is marked lost by Extend, so
		// the runtime will not run it; any other failure is tried again at
		// the next tick, unless the visibility runs out first (see below).
		// The call is bounded, since Receive waits for it, and it ends
		// before the earliest visibility it carries runs out: answered
		// later, even a success proves nothing, since SQS may have handed
		// the message to another consumer meanwhile (and may accept the
		// stale receipt handle). A renewal retried after one SQS did not
		// answer goes out with little of the visibility left.
		deadline := now.Add(renewAfter)
		if first := slices.MinFunc(expires, time.Time.Compare); first.Before(deadline) {
			deadline = first
		}
		ctx, cancel := context.WithDeadline(s.pollCtx, deadline)
		err := s.Extend(ctx, due, s.visibility)
		cancel()
		// The next renewal waits a whole tick from here. A renewal that
		// took a tick or more (one SQS did not answer, which leaves the
		// messages due) would otherwise be followed at once by the next, and
		// Receive, woken by its end, would rarely take the lock first: it
		// would wait renewal after renewal, the messages idle in the buffer.
		tick.Reset(every)
		ended := time.Now()
		s.mu.Lock()
		for i, d := range due {
			j := slices.Index(s.buf, d)
			if e := adapters.EntryError(err, i); e != nil {
				// Its visibility runs out before the next tick could renew
				// it, and another consumer may then receive it: it is no
				// longer this one's to run, as the runtime's lease keeper
				// decides for a running message. Marked lost before Receive
				// may hand it out (under the lock, before bufRenewing
				// closes); its stale receipt handle is never sent again.
				if j >= 0 && !ended.Add(every).Before(s.bufSince[j].Add(s.visibility)) {
					d.Signal.Lose(fmt.Errorf("%w: renewing its visibility while it waited in the Source failed until the visibility timeout ran out: %w", adapters.ErrLeaseLost, e))
				}
				continue
			}
			if !ended.Before(expires[i]) {
				// Answered too late to tell whether SQS renewed this
				// receive or had already redelivered the message.
				if j >= 0 {
					d.Signal.Lose(fmt.Errorf("%w: the renewal of its visibility while it waited in the Source was answered only when the visibility timeout was running out", adapters.ErrLeaseLost))
				}
				continue
			}
			s.stats.bufferRenewed.Add(1)
			if j >= 0 {
				s.bufSince[j] = now
			}
		}
		close(s.bufRenewing)
		s.bufRenewing = nil
		s.mu.Unlock()
	}
}
