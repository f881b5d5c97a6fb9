package awssqs

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
)

// Source receives from one SQS queue. Create it with [New]; the runtime
// (package consumer) drives it. Its methods are safe for concurrent use.
type Source struct {
	client     Client
	url        string
	name       string
	fifo       bool
	visibility time.Duration
	redrive    *redrivePolicy // nil when the queue has none
	opts       options
	pollers    int // ReceiveMessage calls allowed in flight at once
	caps       adapters.Capabilities
	stats      counters

	nacks *visibilityBatcher

	pollCtx   context.Context
	stopPolls context.CancelFunc
	polls     sync.WaitGroup

	mu       sync.Mutex
	buf      []*adapters.Delivery // received, not yet handed to the runtime
	bufSince []time.Time          // when each of buf was last made invisible for a full timeout
	pending  int                  // messages asked for by polls in flight
	inflight int                  // polls in flight
	pollErr  error                // first error of a finished poll, not yet reported
	emptyGen uint64               // counts polls that found nothing
	changed  chan struct{}        // closed and replaced whenever a poll finishes
	closed   bool
	poison   map[string]struct{} // ids handed to the redrive policy early

	// bufRenewing is closed when keepBuffered's renewal on the wire returns;
	// nil when none is. Receive hands nothing out meanwhile.
	bufRenewing chan struct{}
	// renewerStarted is set once keepBuffered runs (from the first poll).
	renewerStarted bool
}

var (
	_ adapters.Source   = (*Source)(nil)
	_ adapters.Extender = (*Source)(nil)
)

// New returns a Source for the queue at queueURL. It reads the queue's
// attributes once (visibility timeout, FIFO, redrive policy), so it fails
// here, with the cause, when the queue, the region or the credentials are
// wrong. ctx bounds that call only.
func New(ctx context.Context, client Client, queueURL string, opts ...Option) (*Source, error) {
	if client == nil {
		return nil, errors.New("awssqs.New: nil client; pass an *sqs.Client (sqs.NewFromConfig)")
	}
	name, err := queueName(queueURL)
	if err != nil {
		return nil, fmt.Errorf("awssqs.New: %w", err)
	}
	o := defaultOptions()
	for _, opt := range opts {
		if opt == nil {
			continue
		}
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	out, err := client.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{
		QueueUrl: aws.String(queueURL),
		AttributeNames: []types.QueueAttributeName{
			types.QueueAttributeNameVisibilityTimeout,
			types.QueueAttributeNameFifoQueue,
			types.QueueAttributeNameRedrivePolicy,
		},
	})
	if err != nil {
		return nil, fmt.Errorf("awssqs.New: reading the attributes of queue %s (check the URL, the region and the credentials): %w", queueURL, err)
	}
	s := &Source{
		client:  client,
		url:     queueURL,
		name:    name,
		fifo:    out.Attributes[string(types.QueueAttributeNameFifoQueue)] == "true" || strings.HasSuffix(name, ".fifo"),
		opts:    o,
		changed: make(chan struct{}),
	}
	s.visibility = o.visibility
	if s.visibility == 0 {
		secs, err := strconv.Atoi(out.Attributes[string(types.QueueAttributeNameVisibilityTimeout)])
		if err != nil || secs < 0 {
			return nil, fmt.Errorf("awssqs.New: queue %s reports VisibilityTimeout %q; set one with WithVisibilityTimeout",
				queueURL, out.Attributes[string(types.QueueAttributeNameVisibilityTimeout)])
		}
		if secs == 0 {
			// A zero timeout makes every received message visible again at
			// once: nothing could be held, so refuse rather than duplicate.
			return nil, fmt.Errorf("awssqs.New: queue %s has VisibilityTimeout 0, so received messages would be redelivered at once; give it a timeout or use WithVisibilityTimeout", queueURL)
		}
		s.visibility = time.Duration(secs) * time.Second
	}
	if p := out.Attributes[string(types.QueueAttributeNameRedrivePolicy)]; p != "" {
		rp, err := parseRedrivePolicy(p)
		if err != nil {
			return nil, fmt.Errorf("awssqs.New: queue %s: %w", queueURL, err)
		}
		s.redrive = rp
	}
	s.pollers = o.pollers
	if s.pollers == 0 {
		s.pollers = DefaultPollers
		if s.fifo {
			// One poll at a time hands out each group's messages in order
			// whatever the broker does; concurrent polls rely on SQS never
			// returning a group's next message while one is in flight.
			s.pollers = 1
		}
	}
	s.caps = adapters.Capabilities{
		Name:             "sqs:" + name,
		System:           "aws_sqs",
		Lease:            s.visibility,
		MaxLeaseAge:      heldAtMost(o.waitTime),
		NackDelay:        true,
		CountsDeliveries: true,
		Ordered:          s.fifo,
		MaxReceive:       s.pollers * o.maxMessages,
		Ack:              adapters.Batching{MaxEntries: maxBatch, Linger: o.ackLinger, MaxCalls: 4},
		Extend:           adapters.Batching{MaxEntries: maxBatch, MaxCalls: 4},
	}
	s.pollCtx, s.stopPolls = context.WithCancel(context.Background())
	s.nacks = newVisibilityBatcher(s, o.nackLinger)
	return s, nil
}

// maxBatch is SQS's limit on entries in DeleteMessageBatch and
// ChangeMessageVisibilityBatch, and on messages per ReceiveMessage.
const maxBatch = 10

func queueName(queueURL string) (string, error) {
	u, err := url.Parse(queueURL)
	if err != nil || u.Scheme == "" || u.Host == "" {
		return "", fmt.Errorf("queue URL %q is not a URL; pass what CreateQueue or GetQueueUrl returned", queueURL)
	}
	path := strings.Trim(u.Path, "/")
	name := path[strings.LastIndexByte(path, '/')+1:]
	if name == "" {
		return "", fmt.Errorf("queue URL %q has no queue name in its path", queueURL)
	}
	return name, nil
}

// Capabilities reports a lease of the visibility timeout, SQS's 12-hour cap,
// delayed redelivery, the broker's receive count, ordering for FIFO queues
// and batches of ten.
func (s *Source) Capabilities() adapters.Capabilities { return s.caps }

// QueueURL returns the URL of the queue the Source reads.
func (s *Source) QueueURL() string { return s.url }

// VisibilityTimeout returns the lease in force: WithVisibilityTimeout or the
// queue's attribute.
func (s *Source) VisibilityTimeout() time.Duration { return s.visibility }

// FIFO reports whether the queue is a FIFO queue.
func (s *Source) FIFO() bool { return s.fifo }

// Close stops receiving, releases (visibility 0) messages received but never
// handed to the runtime unless WithKeepOnClose was given (not those lost
// while they waited, which may be with another consumer), sends the nacks
// still waiting for a batch, and returns. A long poll still in flight is
// cancelled; a message SQS had already picked for it stays invisible until
// its visibility timeout runs out, then comes back. Close never closes the
// client.
func (s *Source) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.broadcastLocked()
	s.mu.Unlock()

	s.stopPolls()
	s.polls.Wait()

	s.mu.Lock()
	left := s.buf
	s.buf, s.bufSince = nil, nil
	s.mu.Unlock()
	// Messages lost while they waited (their visibility ran out, so another
	// consumer may hold them) are not this Source's to release.
	left = slices.DeleteFunc(left, func(d *adapters.Delivery) bool { return d.Signal.LostCause() != nil })

	var err error
	if len(left) > 0 && s.opts.releaseOnClose {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err = s.changeVisibility(ctx, left, make([]int32, len(left)), nil)
		cancel()
		if err == nil {
			s.stats.released.Add(int64(len(left)))
		} else {
			err = fmt.Errorf("awssqs: releasing %d unhandled messages at close (they come back when their visibility timeout runs out): %w", len(left), err)
		}
	}
	s.nacks.close()
	return err
}

// heldAtMost is the cap the runtime holds a delivery to, counted from
// Delivery.ReceivedAt. SQS counts its 12 hours from when it picked the
// message, which can be a whole long poll (waitTime) before the answer that
// sets ReceivedAt arrived: the runtime must give up by then, not visibility
// run out under a running handler. A few seconds more cover the network.
func heldAtMost(waitTime time.Duration) time.Duration {
	return MaxLeaseAge - waitTime - 5*time.Second
}
