package awssqs

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"go.opentelemetry.io/otel"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/option"
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
	caps       adapters.Capabilities
	stats      counters
	tel        *telemetry

	// closing ends when Close is called: it cuts the ReceiveMessage calls
	// in flight. calls counts those calls, each on a goroutine of its own
	// until it has handed its messages out or released them.
	closing     context.Context
	stopClosing context.CancelFunc
	calls       sync.WaitGroup

	mu     sync.Mutex
	closed bool
	poison map[string]struct{} // ids handed to the redrive policy early
}

var (
	_ adapters.Source    = (*Source)(nil)
	_ adapters.Extender  = (*Source)(nil)
	_ adapters.Retryable = (*Source)(nil)
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
	if err := option.Apply(&o, opts); err != nil {
		return nil, err
	}
	mp := o.meterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	tel, err := newTelemetry(mp, name)
	if err != nil {
		return nil, fmt.Errorf("awssqs.New: creating the metrics: %w", err)
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
		client: client,
		url:    queueURL,
		name:   name,
		fifo:   out.Attributes[string(types.QueueAttributeNameFifoQueue)] == "true" || strings.HasSuffix(name, ".fifo"),
		opts:   o,
		tel:    tel,
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
	pollers := o.pollers
	if pollers == 0 {
		pollers = DefaultPollers
		if s.fifo {
			pollers = 1 // see WithPollers
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
		MaxReceive:       o.maxMessages,
		Receivers:        pollers,
		Ack:              adapters.Batching{MaxEntries: maxBatch, Linger: o.ackLinger, MaxCalls: maxCalls},
		Nack:             adapters.Batching{MaxEntries: maxBatch, Linger: o.nackLinger, MaxCalls: maxCalls},
		Extend:           adapters.Batching{MaxEntries: maxBatch, MaxCalls: maxCalls},
	}
	s.closing, s.stopClosing = context.WithCancel(context.Background())
	return s, nil
}

// maxBatch is SQS's limit on entries in DeleteMessageBatch and
// ChangeMessageVisibilityBatch, and on messages per ReceiveMessage.
const maxBatch = 10

// maxCalls is how many calls of each of Ack, Nack and Extend the runtime
// may have in flight at once: a request is a round trip, and four keep
// batches of ten flowing at several thousand messages a second.
const maxCalls = 4

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
// delayed redelivery, the broker's receive count, ordering for FIFO queues,
// receives of WithMaxMessages, WithPollers at once, and batches of ten for
// Ack, Nack and Extend.
func (s *Source) Capabilities() adapters.Capabilities { return s.caps }

// QueueURL returns the URL of the queue the Source reads.
func (s *Source) QueueURL() string { return s.url }

// VisibilityTimeout returns the lease in force: WithVisibilityTimeout or the
// queue's attribute.
func (s *Source) VisibilityTimeout() time.Duration { return s.visibility }

// FIFO reports whether the queue is a FIFO queue.
func (s *Source) FIFO() bool { return s.fifo }

// Close stops receiving and returns once no ReceiveMessage call of the
// Source is in flight, cutting those still waiting (see the package
// documentation, section Receiving). It never closes the client.
func (s *Source) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.stopClosing()
	s.calls.Wait()
	return nil
}

// heldAtMost is the cap the runtime holds a delivery to, counted from
// Delivery.ReceivedAt: SQS counts its 12 hours from when it picked the
// message, up to a whole long poll (waitTime) earlier, and a few seconds
// more cover the network.
func heldAtMost(waitTime time.Duration) time.Duration {
	return MaxLeaseAge - waitTime - 5*time.Second
}
