package kafka

import (
	"strconv"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/prefix"
	"github.com/twmb/franz-go/pkg/kgo"
)

// maxBaseCost is the largest size of the base offset in the metadata.
const maxBaseCost = 10

// partition is one assignment of one topic partition to this member: a new
// value per assignment, so a completion that arrives for an older assignment
// finds its partition fenced. All fields are guarded by Source.mu.
type partition struct {
	topic string
	id    int32
	epoch uint64

	// fenced is set when the partition is revoked or lost: nothing of this
	// assignment is marked done or committed after it.
	fenced bool
	// draining is set when a revoke begins: nothing more is handed out.
	draining bool
	// drained is closed when the last held record is acked or nacked during
	// a revoke drain.
	drained chan struct{}

	tr *prefix.Tracker
	// costs holds, for every tracked position beyond the frontier, an upper
	// bound of what it can add to the commit metadata; costSum is their sum.
	costs    []int
	costHead int
	costSum  int
	// epochCost is the size of the largest encoded leader epoch tracked:
	// the bound of the first run's epoch in the metadata. It never falls.
	epochCost int
	// lastTracked is the highest tracked offset; base is the first one of
	// this assignment, the commit point until a frontier exists.
	lastTracked int64
	base        int64
	hasTracked  bool
	// epochs holds where each leader epoch begins among the tracked
	// offsets, oldest first, so a commit can carry the epoch of the last
	// record it covers.
	epochs []epochStart

	// backlog holds polled records not yet handed out, in offset order.
	backlog  []*kgo.Record
	backHead int
	// lastPolled is the highest offset put in the backlog.
	lastPolled int64
	// requeue holds nacked records (already tracked) to hand out again.
	requeue []*held
	// out holds the handed-out deliveries in hand-out order from outHead
	// on, nil where one was released (no map operation per record); nheld
	// counts them.
	out      []*held
	outHead  int
	nheld    int
	lane     string // "topic/partition": the prefix of its delivery IDs, and its ordering lane
	released bool   // on Source.released

	// skip holds done spans read from the commit metadata on assignment,
	// with the leader epochs of their records (see skipped).
	skip []span

	committed int64     // last committed offset, -1 while unknown
	hwm       int64     // the end to measure lag to (the high watermark, or read committed the last stable offset); -1 while unknown
	hwmAt     time.Time // when hwm was learnt, from a fetch or a refresh (see lagLoop)
	dirty     bool      // something was marked done since the last commit
	paused    bool

	skippedSome bool // takeFromLocked skipped records on its last call
}

// held is a delivery handed to the runtime, with what Ack needs to find its
// place, and the Signal through which a revoke recalls or loses it.
type held struct {
	d   adapters.Delivery
	sig adapters.Signal
	p   *partition
	// slot is the delivery's index in p.out while it is handed out,
	// slotNacked once nacked (until handed out again), and -1 otherwise (not
	// yet handed out, acked, or its partition fenced).
	slot int
}

// slotNacked is held.slot of a nacked record: Ack tells it from one acked.
const slotNacked = -2

func newPartition(topic string, id int32, epoch uint64) *partition {
	return &partition{
		topic:      topic,
		id:         id,
		epoch:      epoch,
		tr:         prefix.New(),
		lane:       topic + "/" + strconv.FormatInt(int64(id), 10),
		lastPolled: -1,
		committed:  -1,
		hwm:        -1,
	}
}

// hold adds h to the handed-out deliveries.
func (p *partition) hold(h *held) {
	if n := len(p.out) - p.outHead; n >= 64 && n >= 2*p.nheld {
		p.compactOut() // mostly released slots: reuse them
	}
	h.slot = len(p.out)
	p.out = append(p.out, h)
	p.nheld++
}

// unhold removes h, which is handed out, from the handed-out deliveries.
func (p *partition) unhold(h *held) {
	p.out[h.slot] = nil
	h.slot = -1
	p.nheld--
	for p.outHead < len(p.out) && p.out[p.outHead] == nil {
		p.outHead++
	}
	if p.outHead == len(p.out) {
		p.out, p.outHead = p.out[:0], 0
	}
}

// compactOut moves the handed-out deliveries to the front of p.out.
func (p *partition) compactOut() {
	n := 0
	for _, h := range p.out[p.outHead:] {
		if h != nil {
			h.slot = n
			p.out[n] = h
			n++
		}
	}
	clear(p.out[n:])
	p.out, p.outHead = p.out[:n], 0
}

// eachHeld calls fn for every handed-out delivery.
func (p *partition) eachHeld(fn func(h *held)) {
	for _, h := range p.out[p.outHead:] {
		if h != nil {
			fn(h)
		}
	}
}

// recallHeld recalls every handed-out delivery, the last handed out first,
// and reports whether there was any. Called under Source.mu with draining
// set. Latest first, because the runtime gives a lane's recalled records
// back in order as it reaches them: had an earlier record been recalled
// first, the runtime could give it back and start a later one not yet
// recalled, which would run before the earlier one's redelivery.
func (p *partition) recallHeld() bool {
	found := false
	for i := len(p.out) - 1; i >= p.outHead; i-- {
		if h := p.out[i]; h != nil {
			h.sig.Recall()
			found = true
		}
	}
	return found
}

// dropHeld forgets every handed-out delivery, appending them to lose.
func (p *partition) dropHeld(lose []*held) []*held {
	for _, h := range p.out[p.outHead:] {
		if h != nil {
			h.slot = -1
			lose = append(lose, h)
		}
	}
	p.out, p.outHead, p.nheld = nil, 0, 0
	return lose
}

// backlogLen is the number of polled records waiting to be handed out.
func (p *partition) backlogLen() int { return len(p.backlog) - p.backHead + len(p.requeue) }

// trackCost bounds what tracking off, a record of leader epoch epoch, adds
// to the metadata: its distance from the previous tracked offset, one for
// the run length it may add, its epoch when it starts a new one (a run of
// another epoch than the run before carries its epoch), and what it adds
// to epochCost.
func (p *partition) trackCost(off int64, epoch int32) int {
	return p.runCost(off, epoch) + p.epochGrowth(epoch)
}

// runCost is trackCost without the growth of epochCost: what the position
// holds until the frontier passes it.
func (p *partition) runCost(off int64, epoch int32) int {
	if !p.hasTracked {
		return 1 + 1
	}
	c := 1 + uvarintLen(uint64(off-p.lastTracked))
	if n := len(p.epochs); n > 0 && p.epochs[n-1].epoch != epoch {
		c += uvarintLen(epochField(epoch))
	}
	return c
}

// epochGrowth is how much tracking a record of epoch grows epochCost.
func (p *partition) epochGrowth(epoch int32) int {
	return max(0, uvarintLen(epochField(epoch))-p.epochCost)
}

// fits reports whether tracking one more position of cost c keeps the worst
// case metadata (every tracked position beyond the frontier done, none
// adjacent) within limit.
func (p *partition) fits(c, limit int) bool {
	if p.tr.Outstanding() == 0 {
		return true
	}
	return metadataFits(maxBaseCost+p.epochCost+p.costSum+c, limit)
}

// epochStart is the first tracked offset written under a leader epoch.
type epochStart struct {
	from  int64
	epoch int32
}

// track tracks off, a record of leader epoch leaderEpoch, whose cost c is
// what trackCost returned.
func (p *partition) track(off int64, leaderEpoch int32, c int) {
	grow := p.epochGrowth(leaderEpoch)
	p.epochCost += grow
	c -= grow
	if n := len(p.epochs); n == 0 || p.epochs[n-1].epoch != leaderEpoch {
		p.epochs = append(p.epochs, epochStart{from: off, epoch: leaderEpoch})
	}
	p.tr.Track(off)
	if !p.hasTracked {
		p.base = off
		p.hasTracked = true
	}
	p.lastTracked = off
	p.costs = append(p.costs, c)
	p.costSum += c
}

// done marks off done and releases the cost of positions the frontier passed.
func (p *partition) done(off int64) {
	before := p.tr.Outstanding()
	p.dirty = true // a done position beyond the frontier changes the metadata
	if !p.tr.Done(off) {
		return
	}
	for released := before - p.tr.Outstanding(); released > 0; released-- {
		p.costSum -= p.costs[p.costHead]
		p.costHead++
	}
	if p.costHead == len(p.costs) {
		p.costs, p.costHead = p.costs[:0], 0
	} else if p.costHead > 64 && p.costHead >= len(p.costs)/2 {
		n := copy(p.costs, p.costs[p.costHead:])
		p.costs, p.costHead = p.costs[:n], 0
	}
}

// commitPoint returns the offset to commit (the next offset to consume) and
// whether there is one.
func (p *partition) commitPoint() (int64, bool) {
	if f, ok := p.tr.Frontier(); ok {
		return f + 1, true
	}
	if p.hasTracked {
		return p.base, true
	}
	return 0, false
}

// leaderEpochBefore returns the leader epoch of the last tracked record
// below at (the last one a commit at at covers; see KIP-320), or -1 when
// none is tracked, and forgets the epochs of older records.
func (p *partition) leaderEpochBefore(at int64) int32 {
	for len(p.epochs) > 1 && p.epochs[1].from < at {
		p.epochs = p.epochs[1:]
	}
	if len(p.epochs) == 0 || p.epochs[0].from >= at {
		return -1
	}
	return p.epochs[0].epoch
}

// metadata encodes the done offsets beyond the commit point, with the leader
// epochs of their records: those this owner tracked, then as many as fit
// of the spans a previous owner recorded beyond them, so that they survive
// an owner revoked before it reached them.
func (p *partition) metadata(at int64, limit int) string {
	e := newDoneEncoder(at)
	i := 0 // p.epochs[i] holds the epoch of the position at hand
	p.tr.DoneBeyond(func(pos int64) {
		for i+1 < len(p.epochs) && p.epochs[i+1].from <= pos {
			i++
		}
		epoch := int32(-1)
		if i < len(p.epochs) {
			epoch = p.epochs[i].epoch
		}
		e.add(pos, pos, epoch)
	})
	if !metadataFits(e.size(), limit) { // cannot happen while fits is honoured; never send an oversized commit
		return ""
	}
	for _, sp := range p.skip {
		from := sp.from
		if p.hasTracked {
			from = max(from, p.lastTracked+1)
		}
		if from > sp.to {
			continue
		}
		if !e.tryAdd(from, sp.to, sp.epoch, limit) {
			break // the rest is run again by the next owner: duplicates, not loss
		}
	}
	return e.String()
}

// skipped reports whether the record at off, written under leader epoch
// epoch, was recorded done by a previous owner (offset and epoch match),
// and forgets spans behind it (offsets arrive in increasing order). Once the
// log is seen to differ from the spans, all are forgotten, since a record's
// offset and epoch fix the log before it: a record of another epoch inside
// a span, or one of a later epoch than the next span's before it (epochs
// never fall along a log, so that span's offsets hold later epochs too).
func (p *partition) skipped(off int64, epoch int32) bool {
	for len(p.skip) > 0 && p.skip[0].to < off {
		p.skip = p.skip[1:]
	}
	if len(p.skip) == 0 {
		p.skip = nil
		return false
	}
	sp := p.skip[0]
	if off < sp.from {
		if epoch > sp.epoch {
			p.skip = nil
		}
		return false
	}
	if epoch != sp.epoch {
		p.skip = nil
		return false
	}
	return true
}
