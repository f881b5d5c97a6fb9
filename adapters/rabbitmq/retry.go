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

// Nack implements adapters.Source.
//
// With no delay the deliveries are requeued at once (basic.nack,
// requeue=true): the runtime does this at shutdown. With a delay, each
// delivery is kept unacked for the delay (it holds a prefetch slot, not a
// worker); then its next attempt is published to the queue as a copy
// carrying HeaderAttempt, and the original is acked only after the broker
// confirmed the copy. When the queue refuses the copy (full, with x-overflow
// reject-publish), the original is requeued instead. Custody of the message
// never leaves the adapter: the original stays unacked until a confirmed
// copy replaces it.
//
// With WithDelayQueues, delays over its threshold publish the copy at once
// to a delay queue that dead-letters it back to the queue after the delay,
// and ack the original after the confirm.
//
// Republishing rather than requeueing keeps an exact attempt count on
// classic queues, which only flag a redelivery.
func (s *Source) Nack(ctx context.Context, ns []adapters.Nack) error {
	var failed map[int]error
	fail := func(i int, err error) {
		if failed == nil {
			failed = map[int]error{}
		}
		failed[i] = err
	}
	for i, n := range ns {
		d, redeliverAfter := n.Delivery, n.After
		h, err := s.own(d)
		if err != nil {
			fail(i, err)
			continue
		}
		if redeliverAfter <= 0 {
			g := h.gen
			g.mu.Lock()
			err = g.rejectLocked(h, true)
			g.mu.Unlock()
			if err != nil {
				fail(i, err)
			}
			continue
		}
		if err := s.retryLater(ctx, d, h, redeliverAfter); err != nil {
			fail(i, err)
		}
	}
	if failed != nil {
		return &adapters.BatchError{Failed: failed}
	}
	return nil
}

// retryLater chooses between waiting in place and a delay queue.
func (s *Source) retryLater(ctx context.Context, d *adapters.Delivery, h *handle, delay time.Duration) error {
	g := h.gen
	g.mu.Lock()
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
		return errors.New("rabbitmq: the delivery was already settled or is already waiting for a retry")
	}
	// Never hold a delivery until the broker's consumer timeout closes the
	// channel (that would lose every delivery on it).
	maxHold := max(0, s.s.consumerTimeout*3/4-time.Since(d.ReceivedAt))
	inPlace := delay <= s.s.delayThreshold || !s.s.delayQueues
	if inPlace && s.s.delayQueues {
		// At most half the prefetch window waits in place; with a prefetch
		// of 1 nothing does, since one waiting delivery would be the whole
		// window and the broker would send nothing else until it ended.
		g.mu.Lock()
		full := g.waiting >= s.s.prefetch/2
		g.mu.Unlock()
		if full || delay > maxHold {
			// Waiting in place would fill the prefetch window or near the
			// consumer timeout: use the delay queue instead.
			inPlace = false
		}
	}
	if !inPlace {
		// Bounded by the adapter, not only by the caller: the runtime's
		// settle context never ends, and a broker that blocks publishers
		// under a resource alarm would hold the confirm, this Nack and the
		// publisher until the alarm cleared.
		pctx, cancel := context.WithTimeout(ctx, s.publishTimeout)
		err := s.toDelayQueue(pctx, d, h, delay)
		cancel()
		if err == nil || errors.Is(err, adapters.ErrConnectionLost) {
			return err
		}
		s.stats.retryFailures.Add(1)
		level := slog.LevelWarn
		if errors.Is(err, errDelayQueueRefused) {
			level = slog.LevelDebug // warned about when the broker refused it
		}
		s.s.logger.Log(ctx, level, "rabbitmq: could not republish a retry to a delay queue; waiting in place instead",
			"queue", s.queue, "id", d.ID, "delay", delay, "error", err)
	}
	if delay > maxHold {
		s.s.logger.Warn("rabbitmq: retry delay cut short: waiting in place that long would near the broker's consumer timeout",
			"queue", s.queue, "id", d.ID, "asked", delay, "waiting", maxHold, "consumer_timeout", s.s.consumerTimeout)
		delay = maxHold
	}
	return s.holdInPlace(d, h, delay)
}

// republishTimeout bounds the publish and confirm of a retry's copy: of an
// in-place retry, which the runtime's context does not reach (the wait
// outlived the Nack), and of a delay-queue retry, within the Nack.
const republishTimeout = 30 * time.Second

// holdInPlace keeps d unacked for delay, then republishes it to the queue.
func (s *Source) holdInPlace(d *adapters.Delivery, h *handle, delay time.Duration) error {
	g := h.gen
	g.mu.Lock()
	switch {
	case g.dead:
		g.mu.Unlock()
		return g.lostErr()
	case h.state != stateHeld:
		g.mu.Unlock()
		return errors.New("rabbitmq: the delivery was already settled")
	}
	h.state = stateWaiting
	g.waiting++
	// Adding to the WaitGroup under g.mu is safe: Close waits only after it
	// marked the current generation dead, which needs g.mu.
	s.wg.Add(1)
	g.mu.Unlock()
	go func() {
		defer s.wg.Done()
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-t.C:
		case <-g.stopped:
			return // lost with its channel; the broker redelivers it
		case <-s.closing:
			return // the channel closes; the broker requeues it
		}
		g.mu.Lock()
		still := !g.dead && h.state == stateWaiting
		g.mu.Unlock()
		if !still {
			return // settled meanwhile: a copy now would be a duplicate
		}
		if !s.beginRepublish() {
			return // the channel closes; the broker requeues the original
		}
		defer s.endRepublish()
		ctx, cancel := context.WithTimeout(s.ctx, s.publishTimeout)
		err := s.republish(ctx, d, h, "", s.queue, brokerAdditions(s.queue, "", s.queue))
		cancel()
		switch {
		case err == nil:
			s.stats.retriedInPlace.Add(1)
		case errors.Is(err, adapters.ErrConnectionLost), errors.Is(err, context.Canceled):
		default:
			s.stats.retryFailures.Add(1)
			s.s.logger.Warn("rabbitmq: could not republish a retry; requeueing it", "queue", s.queue, "id", d.ID, "error", err)
			g.mu.Lock()
			_ = g.rejectLocked(h, true)
			g.mu.Unlock()
		}
	}()
	return nil
}

// toDelayQueue republishes d to the delay queue for delay.
func (s *Source) toDelayQueue(ctx context.Context, d *adapters.Delivery, h *handle, delay time.Duration) error {
	step := delayStep(delay)
	name := delayQueueName(s.queue, step)
	if err := s.pub.declareDelayQueue(ctx, name, step, s.queue); err != nil {
		return err
	}
	// The copy passes two queues that may dead-letter it: the delay queue
	// always does, adding x-death, and the queue itself may.
	err := s.republish(ctx, d, h, "", name, brokerAdditions(name, "", name)+brokerAdditions(s.queue, "", s.queue))
	if errors.Is(err, errUnroutable) {
		s.pub.forget(name) // deleted behind our back: declare it again next time
	}
	if err == nil {
		s.stats.delayQueued.Add(1)
	}
	return err
}

// republish publishes d's next attempt to exchange/key, leaving reserve
// bytes of its content header frame for what the broker adds on the way,
// waits for the confirm, and then acks the original.
func (s *Source) republish(ctx context.Context, d *adapters.Delivery, h *handle, exchange, key string, reserve int) error {
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
	if err := s.pub.publish(ctx, exchange, key, p, reserve, fit); err != nil {
		return err
	}
	if len(shed) > 0 {
		s.s.logger.Warn("rabbitmq: a retry's copy left out custody diagnostic headers to fit the connection's frame_max",
			"queue", s.queue, "id", d.ID, "left_out", shed)
	}
	if s.testHookRepublished != nil {
		s.testHookRepublished()
	}
	g := h.gen
	g.mu.Lock()
	defer g.mu.Unlock()
	// If the channel died meanwhile the original comes back as well as the
	// copy: a duplicate, never a loss.
	return g.ackReplacedLocked(d)
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

// delayQueueInfix separates a delay queue's name from its step. (Delay
// queues were classic queues named with ".custody-delay." before they became
// quorum queues; a new name keeps the two from clashing in a declare.)
const delayQueueInfix = ".custody-retry."

// delayQueueName names the delay queue of queue for one ladder step: the
// queue's name, delayQueueInfix and the step in milliseconds. Where that
// would pass the 255 bytes of an AMQP short string (queue names of more
// than about 230 bytes), it keeps as much of the queue's name as fits, cut
// at a character boundary, then "~" and a hash of the whole name, so that
// the name is still one every consumer of the queue agrees on, and two
// queues that share a long prefix do not share delay queues. (Refused by
// the broker, a longer name made every such retry wait in place, and cost
// the channel each time.)
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

// beginRepublish registers an in-place retry about to publish its copy and
// ack the original, unless the source is closing. Close waits for those
// registered, so it never closes the channel between the copy and the ack
// (which would bring the original back next to its copy).
func (s *Source) beginRepublish() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.republishing++
	return true
}

func (s *Source) endRepublish() {
	s.mu.Lock()
	s.republishing--
	if s.republishing == 0 {
		s.republished.Broadcast()
	}
	s.mu.Unlock()
}
