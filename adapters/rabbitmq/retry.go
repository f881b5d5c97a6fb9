package rabbitmq

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"log/slog"
	"strconv"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
)

// Nack implements adapters.Source. It requeues each delivery at once
// (basic.nack, requeue=true), except, with WithDelayQueues, one with a delay:
// that one is retried through a delay queue, and its original acked only
// once the broker confirmed the copy that replaces it (see the package
// documentation, section Retries).
func (s *Source) Nack(ctx context.Context, ns []adapters.Nack) error {
	var failed entryErrors
	for i, n := range ns {
		h, err := s.own(n.Delivery)
		if err != nil {
			failed.set(i, err)
			continue
		}
		if n.After <= 0 || !s.s.delayQueues {
			g := h.gen
			g.mu.Lock()
			err = g.rejectLocked(h, true)
			g.mu.Unlock()
		} else {
			err = s.retryLater(ctx, n.Delivery, h, n.After)
		}
		if err != nil {
			failed.set(i, err)
		}
	}
	return failed.err()
}

// retryLater retries d through a delay queue, or failing that through the
// queue itself, or requeues it. The publishes of one retry share one
// timeout: the runtime's context never ends, and a broker that blocks
// publishers under a resource alarm would otherwise hold the Nack until the
// alarm cleared.
func (s *Source) retryLater(ctx context.Context, d *adapters.Delivery, h *handle, delay time.Duration) error {
	g := h.gen
	g.mu.Lock()
	if h.disposed {
		g.mu.Unlock()
		return nil // settled by its dead-letter destination: nothing to send
	}
	dead, state, gaveBack := g.dead, h.state, h.gaveBack
	if !dead && state == stateHeld && !gaveBack {
		// Decided under the lock: from here the message comes back (as a
		// copy, or requeued should the copy fail), so an Ack arriving
		// while the copy is published must fail, and so must a second
		// Nack, which would publish a second copy.
		h.gaveBack = true
	}
	g.mu.Unlock()
	switch {
	case dead:
		return g.lostErr()
	case state != stateHeld || gaveBack:
		return errors.New("rabbitmq: the delivery was already settled or given back")
	}
	ctx, cancel := context.WithTimeout(ctx, s.publishTimeout)
	defer cancel()
	err := s.toDelayQueue(ctx, d, h, delay)
	if err == nil || errors.Is(err, adapters.ErrConnectionLost) {
		return err
	}
	s.stats.retryFailures.Add(1)
	level := slog.LevelWarn
	if errors.Is(err, errDelayQueueRefused) {
		level = slog.LevelDebug // warned about when the broker refused it
	}
	s.s.logger.Log(ctx, level, "rabbitmq: could not publish a retry to its delay queue; publishing it to the queue at once",
		"queue", s.queue, "id", d.ID, "delay", delay, "error", err)
	err = s.republish(ctx, d, h, copyQueue, s.queue, brokerAdditions(s.queue, "", s.queue))
	if err == nil || errors.Is(err, adapters.ErrConnectionLost) {
		if err == nil {
			s.stats.retriedAtOnce.Add(1)
		}
		return err
	}
	s.s.logger.Warn("rabbitmq: could not publish a retry to the queue; requeueing it", "queue", s.queue, "id", d.ID, "error", err)
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.rejectLocked(h, true)
}

// republishTimeout bounds the publishes and confirms of one retry.
const republishTimeout = 30 * time.Second

// toDelayQueue republishes d to the delay queue for delay.
func (s *Source) toDelayQueue(ctx context.Context, d *adapters.Delivery, h *handle, delay time.Duration) error {
	step := delayStep(delay)
	name := delayQueueName(s.queue, step)
	if err := s.pub.declareDelayQueue(ctx, name, step, s.queue); err != nil {
		return err
	}
	// The copy passes two queues that may dead-letter it: the delay queue
	// always does, adding x-death, and the queue itself may.
	err := s.republish(ctx, d, h, copyDelayQueue, name, brokerAdditions(name, "", name)+brokerAdditions(s.queue, "", s.queue))
	if errors.Is(err, errUnroutable) {
		s.pub.forget(name) // deleted behind our back: declare it again next time
	}
	if err == nil {
		s.stats.delayQueued.Add(1)
	}
	return err
}

// republish publishes d's next attempt, a copy of kind (copyDelayQueue or
// copyQueue), to queue through the default exchange, leaving reserve bytes
// of its content header frame for what the broker adds on the way, waits
// for the confirm, and then acks the original.
func (s *Source) republish(ctx context.Context, d *adapters.Delivery, h *handle, kind, queue string, reserve int) error {
	m, ok := d.Native.(amqp.Delivery)
	if !ok {
		return errors.New("rabbitmq: the delivery has no AMQP message to republish")
	}
	if h.gen.unreachable() {
		// The original comes back: a copy would deliver the message twice.
		return h.gen.lostErr()
	}
	p := republishing(&m)
	p.Headers[HeaderAttempt] = int64(max(d.Attempt, 1) + 1)
	if _, ok := p.Headers[HeaderFirstReceived]; !ok {
		p.Headers[HeaderFirstReceived] = d.ReceivedAt.UTC().Format(time.RFC3339Nano)
	}
	var shed []string
	fit := func(p *amqp.Publishing, budget, _ int) { shed = fitRetry(p, budget) }
	start := time.Now()
	err := s.pub.publish(ctx, "", queue, p, reserve, fit)
	s.tel.published(kind, time.Since(start), err != nil)
	if err != nil {
		return err
	}
	if len(shed) > 0 {
		s.s.logger.Warn("rabbitmq: a retry's copy left out custody diagnostic headers to fit the connection's frame_max",
			"queue", s.queue, "id", d.ID, "left_out", shed)
	}
	if s.testHookRepublished != nil {
		s.testHookRepublished()
	}
	// If the channel died meanwhile the original comes back as well as the
	// copy: a duplicate, never a loss.
	var failed entryErrors
	h.gen.mu.Lock()
	h.gen.ackLocked([]*adapters.Delivery{d}, &failed, true)
	h.gen.mu.Unlock()
	return failed[0]
}

// delayLadder holds the delay-queue steps. A delay is rounded up to the next
// step, so a source queue gets a bounded number of delay queues and a delay
// is never cut short (a step is at most 2.5 times the one below it, twice it
// from one second up, 1.7 times from two seconds up); delays beyond the last
// step are capped there.
var delayLadder = []time.Duration{
	100 * time.Millisecond, 250 * time.Millisecond, 500 * time.Millisecond,
	time.Second, 2 * time.Second, 3 * time.Second, 5 * time.Second, 7 * time.Second,
	10 * time.Second, 15 * time.Second, 20 * time.Second, 30 * time.Second, 45 * time.Second,
	time.Minute, 90 * time.Second, 2 * time.Minute, 3 * time.Minute, 5 * time.Minute, 7 * time.Minute,
	10 * time.Minute, 15 * time.Minute, 20 * time.Minute, 30 * time.Minute, 45 * time.Minute,
	time.Hour, 90 * time.Minute, 2 * time.Hour, 3 * time.Hour, 4 * time.Hour, 6 * time.Hour,
	9 * time.Hour, 12 * time.Hour, 18 * time.Hour, 24 * time.Hour,
}

func delayStep(d time.Duration) time.Duration {
	for _, s := range delayLadder {
		if d <= s {
			return s
		}
	}
	return delayLadder[len(delayLadder)-1]
}

// delayQueueInfix separates a delay queue's name from its step.
const delayQueueInfix = ".custody-retry."

// delayQueueName names the delay queue of queue for one ladder step: the
// queue's name, delayQueueInfix and the step in milliseconds. Where that
// would pass the 255 bytes of an AMQP short string (queue names of more
// than about 230 bytes), it keeps as much of the queue's name as fits, cut
// at a character boundary, then "~" and a hash of the whole name, so that
// the name is still one every consumer of the queue agrees on, and two
// queues that share a long prefix do not share delay queues.
func delayQueueName(queue string, step time.Duration) string {
	suffix := delayQueueInfix + strconv.FormatInt(step.Milliseconds(), 10) + "ms"
	if len(queue)+len(suffix) <= maxShortstr {
		return queue + suffix
	}
	sum := sha256.Sum256([]byte(queue))
	tag := "~" + hex.EncodeToString(sum[:8])
	keep := maxShortstr - len(suffix) - len(tag)
	for keep > 0 && !utf8.RuneStart(queue[keep]) {
		keep--
	}
	return queue[:keep] + tag + suffix
}
