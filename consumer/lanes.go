package consumer

import (
	"sync"
	"time"
)

// laneRun bounds how many jobs of one lane a worker runs back to back before
// it hands the lane's next job to whichever worker is free: long enough to
// skip a channel hand-off for most jobs of a busy lane, short enough that
// lanes share the workers fairly when there are fewer workers than lanes.
const laneRun = 16

// keyLanePrefix begins the lanes OrderByKey makes of Message.Key, apart from
// the adapters' ordering keys.
const keyLanePrefix = "\x00key:"

// dispatchLaned hands each job to a worker, or queues it behind its lane's
// running job. The lanes are sorted under one lock per batch; the jobs that
// start lanes are handed on once it is released. heads is scratch, returned
// for the next call.
func (r *run) dispatchLaned(jobs []job, heads []*job) []*job {
	heads = heads[:0]
	queued := 0
	r.lanesMu.Lock()
	for i := range jobs {
		j := &jobs[i]
		if j.lane == "" {
			heads = append(heads, j)
			continue
		}
		if q, busy := r.lanes[j.lane]; busy {
			j.queued = true
			queued++
			r.lanes[j.lane] = append(q, j)
			continue
		}
		r.lanes[j.lane] = r.spareQueueLocked()
		heads = append(heads, j)
	}
	r.queuedLocked(queued)
	r.lanesMu.Unlock()
	for _, j := range heads {
		r.work <- j // never blocks: see newRun
	}
	clear(heads)
	return heads
}

// startWorker starts a worker, which runs jobs until r.work is closed.
func (r *run) startWorker(wg *sync.WaitGroup) {
	r.startReplaced(wg, func() {
		for j := r.nextJob(); j != nil; j = r.nextJob() {
			r.runLane(j)
		}
	})
}

// startReplaced runs work on a goroutine counted by wg. A handler that ends
// the goroutine with runtime.Goexit (see handlerExited) gets it replaced,
// so that the run keeps its concurrency and drains.
func (r *run) startReplaced(wg *sync.WaitGroup, work func()) {
	wg.Add(1)
	go func() {
		returned := false
		defer func() {
			if !returned {
				r.startReplaced(wg, work) // before Done: the count never touches zero
			}
			wg.Done()
		}()
		work()
		returned = true
	}()
}

// nextJob waits for a job; nil once r.work is closed. With nothing to do
// right now, it first sends the acks and nacks that wait for company.
func (r *run) nextJob() *job {
	if j := r.waitingJob(); j != nil {
		return j
	}
	r.acks.flush()
	r.nacks.flush()
	return <-r.work
}

// waitingJob returns a job that waits in r.work, or nil.
func (r *run) waitingJob() *job {
	select {
	case j := <-r.work:
		return j
	default:
		return nil
	}
}

// runLane processes j and then, on the same worker, the jobs queued behind
// it in its lane, up to laneRun of them.
func (r *run) runLane(j *job) {
	parked := false
	defer func() {
		if !parked && j.exiting {
			// j's handler called runtime.Goexit: this worker is ending.
			r.handlerExited(j)
		}
	}()
	for n := 1; ; n++ {
		if parked = r.process(j); parked {
			return // parked: its lane, and the jobs linked behind it, wait with it
		}
		s := j.successor
		if s == nil {
			return
		}
		j.successor = nil
		if n == laneRun {
			r.work <- s // never blocks: see newRun
			return
		}
		j = s
	}
}

// next passes j's lane on to the job queued behind it, if any: the worker
// that ran j runs it next (see runLane). Called once j no longer runs.
//
// It takes up to laneRun queued jobs at once and links them through their
// successor fields, so a busy lane costs one lock per run of jobs rather
// than one per job; the lane stays busy until the last of them is done.
// It takes only the next job when the source recalls deliveries: a job
// linked behind another is out of reach of releaseRecalled until the one
// before it ends, and a handler running on past a Kafka revoke's drain
// would keep the recalled jobs linked behind it, and their in-flight
// credit, until it returned.
func (r *run) next(j *job) {
	if j.lane == "" || j.queued || j.successor != nil {
		return // no lane, not its lane's running job, or its successor was taken with it
	}
	r.lanesMu.Lock()
	q := r.lanes[j.lane]
	if len(q) == 0 {
		r.recycleQueueLocked(q)
		delete(r.lanes, j.lane)
		r.lanesMu.Unlock()
		return
	}
	if r.c.batchHandler != nil {
		// Batch workers follow no successor: the lane's next job waits
		// for a worker, to be gathered with the lane's later ones.
		s := q[0]
		s.queued = false
		r.queuedLocked(-1)
		r.lanes[j.lane] = popFront(q, 1)
		r.lanesMu.Unlock()
		r.work <- s // never blocks: see newRun
		return
	}
	n := min(len(q), laneRun)
	if r.recalledOnArrival != nil {
		n = 1
	}
	for i := 0; i < n-1; i++ {
		q[i].successor = q[i+1]
	}
	for _, s := range q[:n] {
		s.queued = false
	}
	r.queuedLocked(-n)
	j.successor = q[0]
	r.lanes[j.lane] = popFront(q, n)
	r.lanesMu.Unlock()
}

// queuedLocked accounts for n more jobs queued behind their lanes' running
// jobs (negative n: that many taken from the queues to run), which are
// kept out of the in-flight window where the source's queued deliveries
// are free (see credit); called with lanesMu held, under which the jobs'
// queued flags change, so that the count follows them exactly.
func (r *run) queuedLocked(n int) {
	if r.queuedFree && n != 0 {
		r.credit.queue(n)
	}
}

// popFront returns q without its first n jobs. Emptied, the queue keeps
// its array for the lane's next jobs: a busy lane that keeps emptying
// would otherwise allocate a queue each time it fills again.
func popFront(q []*job, n int) []*job {
	clear(q[:n])
	if n == len(q) {
		return q[:0]
	}
	return q[n:]
}

// spareQueueLocked returns an empty queue for a lane that becomes busy,
// with the array of one that went idle if there is one; called with
// lanesMu held.
func (r *run) spareQueueLocked() []*job {
	if n := len(r.spareQueues); n > 0 {
		q := r.spareQueues[n-1]
		r.spareQueues = r.spareQueues[:n-1]
		return q
	}
	return nil
}

// recycleQueueLocked keeps the array of an idle lane's empty queue for the
// next lane that becomes busy, a bounded number of them; called with
// lanesMu held.
func (r *run) recycleQueueLocked(q []*job) {
	if cap(q) > 0 && len(r.spareQueues) < maxSpareQueues {
		r.spareQueues = append(r.spareQueues, q[:0])
	}
}

// maxSpareQueues bounds the idle lane queues kept for reuse.
const maxSpareQueues = 256

// giveBackBehind marks the jobs of j's lane queued behind it for which
// behind holds to be given back instead of run.
func (r *run) giveBackBehind(j *job, behind func(*job) bool) {
	for s := j.successor; s != nil; s = s.successor {
		s.giveBack = s.giveBack || behind(s) // taken with j by this worker (see next)
	}
	r.lanesMu.Lock()
	for _, q := range r.lanes[j.lane] {
		q.giveBack = q.giveBack || behind(q)
	}
	r.lanesMu.Unlock()
}

// receivedBefore reports, for j lost at lostAt, which jobs were received
// before the loss, or with j. Every job is, when the time is unknown.
func (r *run) receivedBefore(j *job, lostAt time.Time) func(*job) bool {
	if lostAt.IsZero() {
		return func(*job) bool { return true }
	}
	cut := max(lostAt.Sub(r.started), j.accepted)
	return func(q *job) bool { return q.accepted <= cut }
}
