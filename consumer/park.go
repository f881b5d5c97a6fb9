package consumer

import (
	"sync"
	"time"
)

// Parking: a job that must wait before its next step (a retry in place, a
// dependency outage, a failed dead-letter write) waits without a worker. It
// stays held, its lease renewed and its lane kept, and comes back to a
// worker (through r.work) when the first of these happens: its wait ends;
// its delivery is lost; the adapter recalls it; the drain begins. process
// then decides what it does: run again, or be settled.

// parking is the run's set of parked jobs.
type parking struct {
	mu   sync.Mutex
	jobs map[*job]*time.Timer
}

// park takes j off its worker for delay. Without a lease keeper (a broker
// that holds deliveries without a lease, as RabbitMQ does until its
// consumer timeout), the wait ends no later than the maximum processing
// time, counted from the receive, when process gives the delivery back.
func (r *run) park(j *job, delay time.Duration) {
	// Parked, a job leaves the batch that ran it: whatever settles it next
	// (its dead-letter write, the drain, a loss) passes its lane on and
	// queues its ack itself, as for a job no batch holds.
	j.batched = false
	if r.keeper == nil {
		delay = min(delay, max(time.Until(r.holdEnd(j)), 0))
	}
	p := &r.parking
	p.mu.Lock()
	if p.jobs == nil {
		p.jobs = make(map[*job]*time.Timer)
	}
	p.jobs[j] = time.AfterFunc(delay, func() { r.unpark(j) })
	p.mu.Unlock()
	// A loss or a recall ends the wait at once (and at once if it happened
	// already). The callbacks are removed when the job runs again, before
	// an attempt registers its own.
	j.d.Signal.OnLost(func(error) { r.unpark(j) })
	j.d.Signal.OnRecall(func() { r.unpark(j) })
	if r.draining.Load() {
		r.unpark(j) // the drain began meanwhile and may have missed it
	}
}

// unpark hands j back to a worker, once, if it is parked.
func (r *run) unpark(j *job) {
	p := &r.parking
	p.mu.Lock()
	t, ok := p.jobs[j]
	delete(p.jobs, j)
	p.mu.Unlock()
	if !ok {
		return
	}
	t.Stop()
	j.d.Signal.OnLost(nil)
	j.d.Signal.OnRecall(nil)
	r.work <- j // never blocks: see newRun
}

// unparkAll hands every parked job for which pick holds back to a worker.
func (r *run) unparkAll(pick func(*job) bool) {
	p := &r.parking
	p.mu.Lock()
	var js []*job
	for j := range p.jobs {
		if pick(j) {
			js = append(js, j)
		}
	}
	p.mu.Unlock()
	for _, j := range js {
		r.unpark(j)
	}
}

// holdEnd is when j has been held for the maximum processing time.
func (r *run) holdEnd(j *job) time.Time {
	return r.started.Add(j.accepted + r.cfg.maxProcessing)
}
