package consumer

import "github.com/custody-go/custody/adapters"

// This file gives back recalled deliveries (adapters.Signal.Recall) that
// wait, without waiting for a worker to reach them. process checks for a
// recall before each attempt; this is for the jobs a worker would reach
// only after the handlers before them ended: those queued behind a running
// job of their lane, and those in r.work while every worker is busy.

// startRecalls starts recallLoop if the source reports recalls, and returns
// what stops it and waits for it to return.
func (r *run) startRecalls() (stop func()) {
	rc, ok := r.c.src.(adapters.Recaller)
	if !ok || r.cfg.atMostOnce {
		return func() {}
	}
	recalls := rc.Recalls()
	r.recalledOnArrival = make(chan struct{}, 1)
	stopCh, done := make(chan struct{}), make(chan struct{})
	go func() { defer close(done); r.recallLoop(recalls, stopCh) }()
	return func() { close(stopCh); <-done }
}

// noteRecalledOnArrival wakes recallLoop when a delivery of ds, just
// queued, was recalled already: the adapter recalled it after handing it
// out and before the runtime queued it, so the scan its signal started may
// have missed it, and with every worker busy it would wait for one.
func (r *run) noteRecalledOnArrival(ds []*adapters.Delivery) {
	if r.recalledOnArrival == nil {
		return
	}
	for _, d := range ds {
		if d.Signal.Recalled() {
			select {
			case r.recalledOnArrival <- struct{}{}:
			default:
			}
			return
		}
	}
}

// recallLoop gives back recalled waiting jobs each time the source reports
// recalls, until stop is closed. It stops before the drain (see run), which
// gives back whatever has not started anyway.
func (r *run) recallLoop(recalls <-chan struct{}, stop <-chan struct{}) {
	for {
		select {
		case <-stop:
			return
		case <-recalls:
			r.releaseRecalled()
		case <-r.recalledOnArrival:
			r.releaseRecalled()
		}
	}
}

// recalledWaiting reports whether j, which is not running, was recalled and
// can be given back as released. A lost job is left to process, which
// settles it as lost and gives back its lane.
func recalledWaiting(j *job) bool {
	return !j.ackedEarly && j.recalled() && j.lostCause() == nil
}

// releaseRecalled gives back the recalled jobs waiting in r.work and in the
// lanes' queues. The jobs of r.work that were not recalled go back to it;
// they are unordered jobs and lane heads, one per lane, so that changes no
// order that counts. Giving a job back never runs another, so no order can
// break; and the adapter recalls a lane's later deliveries first (see
// Signal.Recall), so a job still to run is never behind one given back.
func (r *run) releaseRecalled() {
	r.unparkAll(recalledWaiting) // into r.work, given back just below
	var keep, give []*job
	for j := r.waitingJob(); j != nil; j = r.waitingJob() {
		switch {
		case !recalledWaiting(j):
			keep = append(keep, j)
		case j.lane == "":
			give = append(give, j)
		default:
			keep = r.releaseLaneHead(j, keep)
		}
	}
	for _, j := range keep {
		r.work <- j // never blocks: they were taken from it
	}
	// The jobs taken from the lanes' queues are settled after the lock is
	// released: stopping a lease may wait for a renewal in flight, a round
	// trip to the broker, and every worker finishing a laned job waits for
	// lanesMu meanwhile. Queued, they hold no lane to pass on.
	r.lanesMu.Lock()
	for lane, q := range r.lanes {
		kept := q[:0]
		for _, j := range q {
			if recalledWaiting(j) {
				give = append(give, j)
			} else {
				kept = append(kept, j)
			}
		}
		if len(kept) < len(q) {
			clear(q[len(kept):])
			r.lanes[lane] = kept // still busy: its running job passes it on
		}
	}
	r.lanesMu.Unlock()
	for _, j := range give {
		r.settle(j, released(whyRecalled))
	}
}

// releaseLaneHead gives back j, a recalled job that heads its lane, and the
// recalled jobs after it, passing the lane on as a worker would; the first
// job of the lane that was not recalled is appended to keep, for a worker.
func (r *run) releaseLaneHead(j *job, keep []*job) []*job {
	for j != nil {
		if !recalledWaiting(j) {
			return append(keep, j)
		}
		r.settle(j, released(whyRecalled)) // passes the lane on to j.successor
		s := j.successor
		j.successor = nil
		j = s
	}
	return keep
}
