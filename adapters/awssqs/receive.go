package awssqs

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
)

// systemAttributes are the system attributes every receive asks for,
// through both AttributeNames (deprecated, but the only field some emulators
// read) and MessageSystemAttributeNames (what SQS documents now).
var systemAttributes = []string{
	string(types.MessageSystemAttributeNameApproximateReceiveCount),
	string(types.MessageSystemAttributeNameApproximateFirstReceiveTimestamp),
	string(types.MessageSystemAttributeNameSentTimestamp),
	string(types.MessageSystemAttributeNameMessageGroupId),
	string(types.MessageSystemAttributeNameMessageDeduplicationId),
	string(types.MessageSystemAttributeNameSequenceNumber),
	// The X-Ray trace header, which a DeadLetter copy keeps.
	string(types.MessageSystemAttributeNameAWSTraceHeader),
}

// Receive makes one ReceiveMessage call for up to min(max, WithMaxMessages)
// messages, long-polling for WithWaitTime, and returns what it brought: an
// empty result and a nil error when the queue was empty, ctx's error once
// ctx is done, and an error wrapping adapters.ErrClosed after Close.
//
// A Receive whose ctx ends while its call is in flight returns at once and
// hands out nothing; the call goes on until SQS answers (or Close or its
// timeout cuts it), and the messages it brought are made visible again at
// once (see the package documentation, section Receiving).
func (s *Source) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, adapters.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		s.mu.Unlock()
		return nil, err
	}
	if max <= 0 {
		s.mu.Unlock()
		return nil, nil
	}
	s.calls.Add(1)
	s.mu.Unlock()

	got := make(chan polled) // unbuffered: see poll
	abandoned := make(chan struct{})
	go s.poll(ctx, min(max, s.opts.maxMessages), got, abandoned)
	var p polled
	select {
	case p = <-got:
	case <-ctx.Done():
		close(abandoned)
		return nil, ctx.Err()
	}
	if s.closing.Err() != nil || ctx.Err() != nil {
		// The answer came as the caller or Close gave up on it.
		s.release(p.ds)
		if s.closing.Err() != nil {
			return nil, adapters.ErrClosed
		}
		return nil, ctx.Err()
	}
	if p.err != nil {
		return nil, p.err
	}
	if len(p.ds) == 0 && p.empty && s.opts.waitTime == 0 {
		// An idle consumer of short polls must not spin.
		t := time.NewTimer(s.opts.emptyPollBackoff)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-s.closing.Done():
			return nil, adapters.ErrClosed
		}
	}
	return p.ds, nil
}

// polled is the outcome of one ReceiveMessage call.
type polled struct {
	ds    []*adapters.Delivery
	empty bool // SQS returned no message
	err   error
}

// poll makes one ReceiveMessage call for up to n messages and hands the
// deliveries to the Receive waiting on got, or, once abandoned is closed
// (that Receive's ctx ended), makes them visible again. The call is not cut
// when the Receive gives up: SQS may have picked messages for it, and only
// the answer says which. Close and the timeout (the long poll's wait plus
// the request timeout) cut it.
func (s *Source) poll(ctx context.Context, n int, got chan<- polled, abandoned <-chan struct{}) {
	defer s.calls.Done()
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
		// The SDK's retry of a call whose answer was lost reuses this id,
		// so SQS returns the same messages again instead of leaving them
		// invisible, their groups blocked. Random: SQS matches ids across
		// all the queue's consumers.
		in.ReceiveRequestAttemptId = aws.String(rand.Text())
	}
	s.stats.receives.Add(1)
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.opts.waitTime+s.opts.requestTimeout)
	stop := context.AfterFunc(s.closing, cancel)
	asked := time.Now()
	out, err := s.client.ReceiveMessage(cctx, in)
	stop()
	cancel()
	now := time.Now()
	var p polled
	var poison []*adapters.Delivery
	switch {
	case err == nil:
		p.ds = make([]*adapters.Delivery, 0, len(out.Messages))
		for _, m := range out.Messages {
			d := s.delivery(m, now)
			d.Handle.(*handle).asked = asked
			p.ds = append(p.ds, d)
		}
		s.stats.received.Add(int64(len(p.ds)))
		s.tel.receivedN(len(p.ds))
		if len(p.ds) == 0 {
			p.empty = true
			s.stats.emptyReceives.Add(1)
			s.tel.request(opReceive, resultEmpty)
		} else {
			s.tel.request(opReceive, resultOK)
		}
		p.ds, poison = s.filterPoison(p.ds)
	case s.closing.Err() != nil:
		s.tel.request(opReceive, resultError)
		p.err = adapters.ErrClosed
	default:
		s.stats.receiveErrors.Add(1)
		s.tel.request(opReceive, resultError)
		p.err = fmt.Errorf("awssqs: ReceiveMessage on %s: %w", s.url, err)
	}
	select {
	case got <- p:
	case <-abandoned:
		s.release(p.ds)
	}
	s.releasePoison(poison)
}

// release makes ds, received but not handed out, visible again at once. A
// failure only keeps them away until their visibility timeout runs out.
func (s *Source) release(ds []*adapters.Delivery) {
	if len(ds) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.opts.requestTimeout)
	defer cancel()
	err := s.changeVisibility(ctx, ds, make([]int32, len(ds)), nil)
	released := len(ds)
	if err != nil {
		released = 0
		for i := range ds {
			if adapters.EntryError(err, i) == nil {
				released++
			}
		}
	}
	s.stats.released.Add(int64(released))
	s.tel.releasedN(released)
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
	// signal is the delivery's Signal; NativeDeadLetter.Send loses through
	// it a delivery whose release may have landed unanswered.
	signal adapters.Signal
	// asked is when the ReceiveMessage call that brought the message was
	// made. SQS received the message no earlier, so its 12 hours of
	// invisibility end no later than asked + 12 h; Delivery.ReceivedAt,
	// taken when the answer arrived, can be later than SQS's receive.
	asked time.Time

	// Under Source.mu: renewals of the message on the wire; whether
	// NativeDeadLetter.Send gave it back, after which it is not renewed;
	// and, while Send waits for those renewals, a channel closed when the
	// last returns.
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
