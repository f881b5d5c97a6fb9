package awssqs

import (
	"context"
	"fmt"
	"strconv"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
)

var _ adapters.BacklogReporter = (*Source)(nil)

// Backlog asks SQS for the queue's backlog in one GetQueueAttributes
// request (billed; it needs sqs:GetQueueAttributes): Waiting is
// ApproximateNumberOfMessages, InFlight ApproximateNumberOfMessagesNotVisible
// (received by any consumer, not yet deleted, their visibility timeout not
// run out). Delayed messages (ApproximateNumberOfMessagesDelayed) are in
// neither. OldestAge stays zero: only CloudWatch's
// ApproximateAgeOfOldestMessage tells it. SQS documents the counts as
// approximate, settling up to a minute after producers stop. Backlog fails
// with adapters.ErrClosed once the Source is closed.
func (s *Source) Backlog(ctx context.Context) (adapters.Backlog, error) {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return adapters.Backlog{}, adapters.ErrClosed
	}
	ctx, cancel := context.WithTimeout(ctx, s.opts.requestTimeout)
	defer cancel()
	stop := context.AfterFunc(s.closing, cancel)
	defer stop()
	out, err := s.client.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{
		QueueUrl: aws.String(s.url),
		AttributeNames: []types.QueueAttributeName{
			types.QueueAttributeNameApproximateNumberOfMessages,
			types.QueueAttributeNameApproximateNumberOfMessagesNotVisible,
		},
	})
	if err != nil {
		s.tel.request(opAttributes, resultError)
		if s.closing.Err() != nil {
			return adapters.Backlog{}, adapters.ErrClosed
		}
		return adapters.Backlog{}, fmt.Errorf("awssqs: reading the backlog of queue %s (GetQueueAttributes; the client needs sqs:GetQueueAttributes): %w", s.url, err)
	}
	s.tel.request(opAttributes, resultOK)
	b := adapters.Backlog{Waiting: -1, InFlight: -1}
	if n, err := strconv.ParseInt(out.Attributes[string(types.QueueAttributeNameApproximateNumberOfMessages)], 10, 64); err == nil {
		b.Waiting = n
	}
	if n, err := strconv.ParseInt(out.Attributes[string(types.QueueAttributeNameApproximateNumberOfMessagesNotVisible)], 10, 64); err == nil {
		b.InFlight = n
	}
	return b, nil
}
