package consumer

import (
	"context"
	"sync"

	"github.com/custody-go/custody/adapters"
)

// PauseMode says what a paused consumer does with the deliveries it holds.
type PauseMode int

const (
	// FinishHeld: the deliveries already held are handled and settled as
	// usual; only receiving stops.
	FinishHeld PauseMode = iota
	// GiveBackWaiting: the deliveries not yet running (waiting for a
	// worker, or for a retry) are given back at once; those running
	// finish. On brokers that count deliveries (SQS, RabbitMQ quorum
	// queues), a delivery given back counts as received once more.
	GiveBackWaiting
)

// Pause stops intake: the consumer stops receiving, without leaving its
// group or closing its connection (a Kafka source stops fetching, its
// partitions stay assigned), and handles what it holds as mode says, its
// leases kept alive. Resume starts intake again. Pause and Resume may be
// called from any goroutine, before or during Run; a consumer paused
// before Run starts paused.
func (c *Consumer) Pause(mode PauseMode) {
	c.intake.pause(mode == GiveBackWaiting)
	// The Receives under way are cancelled (they hand out nothing after
	// that); once they have returned, nothing more comes in.
	c.intake.awaitIdle()
	c.reportPaused(true)
	if r := c.cur.Load(); r != nil && mode == GiveBackWaiting {
		r.releasePaused()
	}
}

// Resume starts intake again after Pause. A tripped kill switch keeps
// intake stopped until it closes.
func (c *Consumer) Resume() {
	c.intake.resume()
	c.reportPaused(false)
}

// reportPaused records the state and tells the source, if it fetches
// ahead on its own (adapters.Pauser).
func (c *Consumer) reportPaused(paused bool) {
	c.syncSourcePause()
	if paused {
		c.state.CompareAndSwap(int32(StateRunning), int32(StatePaused))
	} else if !c.intake.closed() {
		c.state.CompareAndSwap(int32(StatePaused), int32(StateRunning))
	}
}

// syncSourcePause tells a source that fetches ahead on its own
// (adapters.Pauser) whether intake is stopped, by Pause or by the kill
// switch, whichever changed it: the source fetches only while neither
// holds intake. Nothing is told before Run (which tells it at its start).
func (c *Consumer) syncSourcePause() {
	p, ok := c.src.(adapters.Pauser)
	if !ok || c.cur.Load() == nil {
		return
	}
	sp := &c.sourcePause
	sp.Lock()
	defer sp.Unlock()
	closed := c.intake.closed()
	if closed == sp.paused {
		return
	}
	sp.paused = closed
	if closed {
		p.Pause()
	} else {
		p.Resume()
	}
}

// gate holds the receivers while intake is stopped: by Pause, or by a
// tripped kill switch.
type gate struct {
	mu       sync.Mutex
	paused   bool // by Pause
	giveBack bool // Pause(GiveBackWaiting)
	tripped  bool // by the kill switch
	open     chan struct{}
	// stopped is cancelled when the gate closes, ending the Receives
	// under way: a long poll would otherwise hand out what arrives after
	// the pause. A new one is made when the gate opens.
	stopped context.Context
	stop    context.CancelFunc
	// receiving counts the Receives under way; idle is signalled when it
	// falls to zero, for Pause to wait on.
	receiving int
	idle      *sync.Cond
}

// init opens the gate; New calls it.
func (g *gate) init() {
	g.idle = sync.NewCond(&g.mu)
	g.open = make(chan struct{})
	close(g.open)
	g.stopped, g.stop = context.WithCancel(context.Background())
}

// receiveContext returns the context Receives run with while the gate is
// open: done when ctx is, or when the gate closes. It reuses the one it
// made last while the gate has not closed since, so that a Receive costs no
// allocation for it.
func (g *gate) receiveContext(ctx context.Context, last *gatedContext) context.Context {
	g.mu.Lock()
	stopped := g.stopped
	g.mu.Unlock()
	if last.ctx != nil && last.stopped == stopped && last.ctx.Err() == nil {
		return last.ctx
	}
	last.release()
	last.ctx, last.cancel = context.WithCancel(ctx)
	last.stopped = stopped
	last.unlink = context.AfterFunc(stopped, last.cancel)
	return last.ctx
}

// gatedContext is a receiver's context for one open period of the gate.
type gatedContext struct {
	ctx     context.Context
	cancel  context.CancelFunc
	unlink  func() bool
	stopped context.Context
}

func (c *gatedContext) release() {
	if c.unlink != nil {
		c.unlink()
	}
	if c.cancel != nil {
		c.cancel()
	}
	*c = gatedContext{}
}

// beginReceive and endReceive bracket a Receive.
func (g *gate) beginReceive() {
	g.mu.Lock()
	g.receiving++
	g.mu.Unlock()
}

func (g *gate) endReceive() {
	g.mu.Lock()
	g.receiving--
	if g.receiving == 0 {
		g.idle.Broadcast()
	}
	g.mu.Unlock()
}

// awaitIdle waits until no Receive is under way.
func (g *gate) awaitIdle() {
	g.mu.Lock()
	for g.receiving > 0 {
		g.idle.Wait()
	}
	g.mu.Unlock()
}

func (g *gate) closed() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.paused || g.tripped
}

// givingBack reports whether jobs not yet running are to be given back.
func (g *gate) givingBack() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.paused && g.giveBack
}

func (g *gate) pause(giveBack bool) { g.set(func() { g.paused, g.giveBack = true, giveBack }) }
func (g *gate) resume()             { g.set(func() { g.paused, g.giveBack = false, false }) }
func (g *gate) trip(on bool)        { g.set(func() { g.tripped = on }) }

// set changes the gate's state under its lock, opening or closing it.
func (g *gate) set(change func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	wasOpen := !g.paused && !g.tripped
	change()
	isOpen := !g.paused && !g.tripped
	switch {
	case isOpen && !wasOpen:
		close(g.open)
		g.stopped, g.stop = context.WithCancel(context.Background())
	case !isOpen && wasOpen:
		g.open = make(chan struct{})
		g.stop()
	}
}

// wait blocks while intake is stopped; it reports false when ctx ends
// first.
func (g *gate) wait(ctx context.Context) bool {
	for {
		g.mu.Lock()
		open := g.open
		g.mu.Unlock()
		select {
		case <-open:
			if !g.closed() {
				return true
			}
		case <-ctx.Done():
			return false
		}
	}
}

// releasePaused gives back, at once, the jobs that wait for a worker and
// the jobs parked for a retry (Pause(GiveBackWaiting)); running ones
// finish. A lane's jobs go back in order, its head first.
func (r *run) releasePaused() {
	r.unparkAll(func(*job) bool { return true }) // into r.work
	for j := r.waitingJob(); j != nil; j = r.waitingJob() {
		if !r.c.intake.givingBack() {
			r.work <- j // resumed meanwhile: never blocks, it was taken from it
			return
		}
		for j != nil {
			r.settle(j, released(whyPaused)) // passes the lane on to j.successor
			s := j.successor
			j.successor = nil
			j = s
		}
	}
}
