package awssqs

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync/atomic"

	"github.com/custody-go/custody/adapters"
)

// redrivePolicy is the part of a queue's RedrivePolicy attribute the Source reads.
type redrivePolicy struct {
	DeadLetterTargetArn string
	MaxReceiveCount     int
}

func parseRedrivePolicy(s string) (*redrivePolicy, error) {
	var raw struct {
		DeadLetterTargetArn string          `json:"deadLetterTargetArn"`
		MaxReceiveCount     json.RawMessage `json:"maxReceiveCount"`
	}
	if err := json.Unmarshal([]byte(s), &raw); err != nil {
		return nil, fmt.Errorf("cannot read its RedrivePolicy %q: %w", s, err)
	}
	// SQS returns the count as a string; documentation examples use a number.
	count := string(raw.MaxReceiveCount)
	if unq, err := strconv.Unquote(count); err == nil {
		count = unq
	}
	n, err := strconv.Atoi(count)
	if err != nil || n < 1 {
		return nil, fmt.Errorf("its RedrivePolicy %q has no valid maxReceiveCount", s)
	}
	return &redrivePolicy{DeadLetterTargetArn: raw.DeadLetterTargetArn, MaxReceiveCount: n}, nil
}

// NativeDeadLetter is an adapters.DeadLetter that leaves dead-lettering to
// the queue's own redrive policy: SQS moves a message to the dead-letter
// queue when a receive would take its receive count past maxReceiveCount.
// Create it with [Source.NativeDeadLetter].
//
// Send makes the message visible again at once and tells the runtime that
// it settled the original (adapters.OriginalSettler), so the runtime does
// not delete it: the next receive, by any consumer, moves it. The release
// waits for a renewal of the message on the wire, and later renewals are not
// sent, so that none hides it again. The dead-letter queue then holds the
// original message untouched, with SQS's own DeadLetterQueueSourceArn and
// receive count; the runtime's diagnostics (error text, failure times) are
// not attached, only logged and counted by the runtime. Use [DeadLetter] to
// keep them.
//
// A message failing with a permanent error before its receive count reaches
// maxReceiveCount cannot skip the remaining receives: SQS only moves it once
// the count is reached. This Source recognises such a message when it comes
// back and releases it again without running the handler, until SQS moves
// it; another process receiving it runs its handler again.
type NativeDeadLetter struct {
	s          *Source
	maxReceive int
	handed     atomic.Int64
}

var _ adapters.DeadLetter = (*NativeDeadLetter)(nil)

// NativeDeadLetterOption configures [Source.NativeDeadLetter].
type NativeDeadLetterOption func(*nativeDeadLetterOptions)

type nativeDeadLetterOptions struct {
	allowMismatch bool
	logger        *slog.Logger
}

// AllowRedriveMismatch turns the start-up check of [Source.NativeDeadLetter]
// from an error into a warning logged to logger (nil: slog.Default()).
func AllowRedriveMismatch(logger *slog.Logger) NativeDeadLetterOption {
	return func(o *nativeDeadLetterOptions) {
		o.allowMismatch = true
		o.logger = logger
	}
}

// ErrRedriveMismatch is returned (wrapped) by [Source.NativeDeadLetter] when
// the queue's maxReceiveCount and the consumer's MaxAttempts disagree.
var ErrRedriveMismatch = errors.New("awssqs: the queue's redrive maxReceiveCount and the consumer's MaxAttempts disagree")

// NativeDeadLetter returns the dead-letter destination that leaves dead
// letters to this Source's queue's redrive policy. maxAttempts is the
// consumer's Retry.MaxAttempts. It fails when the queue has no redrive
// policy, and when its maxReceiveCount differs from maxAttempts (unless
// AllowRedriveMismatch): with fewer receives SQS moves messages before the
// consumer's retries are spent; with more, messages exhausted by the
// consumer are received and released again until SQS's count is reached.
func (s *Source) NativeDeadLetter(maxAttempts int, opts ...NativeDeadLetterOption) (*NativeDeadLetter, error) {
	var o nativeDeadLetterOptions
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	if maxAttempts < 1 {
		return nil, fmt.Errorf("awssqs: Source.NativeDeadLetter(%d): maxAttempts must be the consumer's Retry.MaxAttempts, at least 1", maxAttempts)
	}
	if s.redrive == nil {
		return nil, fmt.Errorf("awssqs: Source.NativeDeadLetter: queue %s has no RedrivePolicy; give it one with maxReceiveCount %d, or use NewDeadLetter", s.url, maxAttempts)
	}
	if n := s.redrive.MaxReceiveCount; n != maxAttempts {
		err := fmt.Errorf("%w: queue %s moves messages to %s after maxReceiveCount=%d receives, but the consumer retries up to MaxAttempts=%d; set them equal",
			ErrRedriveMismatch, s.url, s.redrive.DeadLetterTargetArn, n, maxAttempts)
		if !o.allowMismatch {
			return nil, err
		}
		logger := o.logger
		if logger == nil {
			logger = slog.Default()
		}
		logger.Warn("custody: "+err.Error(), "queue", s.name, "maxReceiveCount", n, "maxAttempts", maxAttempts)
	}
	return &NativeDeadLetter{s: s, maxReceive: s.redrive.MaxReceiveCount}, nil
}

// MaxReceiveCount returns the queue's redrive maxReceiveCount.
func (r *NativeDeadLetter) MaxReceiveCount() int { return r.maxReceive }

// HandedOver counts messages Send gave back to the redrive policy.
func (r *NativeDeadLetter) HandedOver() int64 { return r.handed.Load() }

// Send gives d back to SQS (visibility 0) for its redrive policy to move, in
// a request of its own, and returns nil once SQS has it back. It returns an
// error, and leaves d unsettled, only when the visibility change failed for
// a reason other than a lost lease (a lost lease means SQS already has the
// message back, which is what Send wants), or was not answered before ctx
// ended. Such an error also loses d (adapters.ErrLeaseLost): the release may
// have landed, so d's receipt handle is not used again.
func (r *NativeDeadLetter) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	if d.Queue != r.s.name {
		return fmt.Errorf("awssqs: the NativeDeadLetter of queue %s cannot dead-letter a message from %q", r.s.name, d.Queue)
	}
	if d.Attempt < r.maxReceive {
		r.s.rememberPoison(d.ID)
	}
	// The runtime renews the message until Send returns: later renewals are
	// not sent, and those on the wire must land before the release, or one
	// would hide the message for a whole timeout again.
	if h, ok := d.Handle.(*handle); ok {
		r.s.mu.Lock()
		h.handedBack = true
		var renewed chan struct{}
		if h.renewing > 0 {
			if h.renewed == nil {
				h.renewed = make(chan struct{})
			}
			renewed = h.renewed
		}
		r.s.mu.Unlock()
		if renewed != nil {
			select {
			case <-renewed:
			case <-ctx.Done():
				return fmt.Errorf("awssqs: handing message %s back to the redrive policy: waiting for its renewal: %w", d.ID, ctx.Err())
			}
		}
	}
	err := adapters.EntryError(r.s.changeVisibility(ctx, []*adapters.Delivery{d}, []int32{0}, nil), 0)
	if err != nil && !errors.Is(err, adapters.ErrLeaseLost) {
		err = fmt.Errorf("awssqs: handing message %s back to the redrive policy: %w", d.ID, err)
		// The release may have landed unanswered, and another consumer may
		// hold the message under a new receipt handle, whose visibility a
		// nack or renewal with this stale one could change (see
		// changeVisibility): lose the delivery.
		if d.Signal != nil {
			d.Signal.Lose(fmt.Errorf("%w: %w", adapters.ErrLeaseLost, err))
		}
		return err
	}
	r.handed.Add(1)
	return nil
}

// SettlesOriginal reports that Send disposes of the original itself (it
// gives the message back to the redrive policy), so the runtime neither
// acks nor nacks it afterwards (adapters.OriginalSettler).
func (r *NativeDeadLetter) SettlesOriginal(*adapters.Delivery) bool { return true }
