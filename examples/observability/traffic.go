package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/custody-go/custody/adapters/memory"
)

// phase is a point of the traffic at which run reports what the probes say.
type phase int

const (
	// phaseIdle: the consumer runs, nothing is published yet.
	phaseIdle phase = iota
	// phaseTripped: the payment service is down and the kill switch has
	// tripped; the service is still down.
	phaseTripped
	// phaseRecovered: the service is back, the switch closed, the queue
	// empty.
	phaseRecovered
)

// settleTimeout bounds each wait of the traffic: a hang guard, far above
// what the waits take.
const settleTimeout = 30 * time.Second

// traffic publishes the demo's orders in two rounds and waits for each to
// settle, calling at for each phase.
//
// The first round is 40 orders and three more, among which some fail:
// every seventh order times out once (retried), #13 panics once, one
// message does not parse (dead-lettered), one order's ack is lost
// (redelivered: a sequential duplicate, skipped), and one order's lease is
// lost while its slow call runs on (redelivered while it runs: overlapping
// duplicates, deferred, then a sequential one). Then order 5 is published
// again (a sequential duplicate).
//
// The second round is an outage: the payment service goes down and 30
// orders arrive. The attempts fail as Unavailable, which uses up no
// attempt, until the kill switch trips and stops intake; the orders wait,
// none is dead-lettered. The service comes back, the switch half-opens,
// its probes succeed, it closes, and the orders run.
func (d *demo) traffic(ctx context.Context, at func(phase)) error {
	var round []memory.Message
	for i := 1; i <= 40; i++ {
		round = append(round, orderMessage(order{ID: strconv.Itoa(i), Amount: 10 * i, Flaky: i%7 == 0, Panic: i == 13}, ""))
	}
	round = append(round,
		orderMessage(order{ID: ackLostOrder, Amount: 1}, ""),
		orderMessage(order{ID: leaseLostOrder, Amount: 1, SlowMS: 1500}, ""),
		memory.Message{ID: "order-poison", Body: []byte(`{"id": "poison", "amount": "ten"`), Headers: map[string]string{"order-id": "poison"}},
	)
	if err := d.broker.Publish(ctx, queue, round...); err != nil {
		return err
	}
	if err := d.settled(ctx); err != nil {
		return err
	}
	// Its producer publishes order 5 again.
	if err := d.broker.Publish(ctx, queue, orderMessage(order{ID: "5", Amount: 50}, "order-5-again")); err != nil {
		return err
	}
	if err := d.settled(ctx); err != nil {
		return err
	}

	d.shop.paymentsDown.Store(true)
	round = round[:0]
	for i := 101; i <= 130; i++ {
		round = append(round, orderMessage(order{ID: strconv.Itoa(i), Amount: i}, ""))
	}
	if err := d.broker.Publish(ctx, queue, round...); err != nil {
		return err
	}
	if err := d.await(ctx, "the kill switch to trip", func() bool { return d.consumer.Status().KillSwitch == "open" }); err != nil {
		return err
	}
	at(phaseTripped)
	// The outage goes on past the cooldown: the switch half-opens, its
	// first probe fails, and it opens again.
	if err := sleep(ctx, 1500*time.Millisecond); err != nil {
		return err
	}
	d.shop.paymentsDown.Store(false)
	if err := d.await(ctx, "the kill switch to close", func() bool { return d.consumer.Status().KillSwitch == "closed" }); err != nil {
		return err
	}
	if err := d.settled(ctx); err != nil {
		return err
	}
	at(phaseRecovered)
	return nil
}

// orderMessage is o as a message; its id is "order-" and o's id unless
// given.
func orderMessage(o order, id string) memory.Message {
	body, err := json.Marshal(o)
	if err != nil {
		panic(err) // an order always marshals
	}
	if id == "" {
		id = "order-" + o.ID
	}
	return memory.Message{ID: id, Body: body, Headers: map[string]string{"order-id": o.ID}}
}

// settled waits until the queue holds nothing: every order acked or
// dead-lettered.
func (d *demo) settled(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()
	return d.broker.WaitEmpty(ctx, queue)
}

// await polls cond until it holds.
func (d *demo) await(ctx context.Context, what string, cond func() bool) error {
	ctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()
	for !cond() {
		if err := sleep(ctx, 20*time.Millisecond); err != nil {
			return fmt.Errorf("waiting for %s: %w", what, err)
		}
	}
	return nil
}

// sleep waits d, or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}
