package kafka

import (
	"context"
	"fmt"

	"github.com/custody-go/custody/adapters"
)

// ErrRewound is the cause given to records in flight when the client rewinds
// their partition after the broker lost data (franz-go reports a
// kgo.ErrDataLoss: an unclean leader election, a log truncated under the
// consumer). It wraps adapters.ErrRevoked: the records are fetched again by
// this consumer, from the rewind point or the last done prefix, whichever is
// lower, and nothing of them is committed by the old assignment.
var ErrRewound = fmt.Errorf("%w: the broker lost records and the client rewound the partition; its records are fetched again", adapters.ErrRevoked)

// rewindLocked handles a rewind of p to resetTo, at or below the highest
// offset already polled (see the package documentation, section Data loss):
// the broker replaced the records from resetTo on, and the new ones must
// run although the old filter of polled offsets would drop them. p is
// fenced like a lost partition, its records in flight appended to lose, and
// a new epoch np takes its place, starting at from: resetTo, or p's commit
// point if lower. The caller fetches from there again when from is below
// resetTo. np commits from at once, even below what was committed.
func (s *Source) rewindLocked(p *partition, resetTo int64, lose []*held) (np *partition, from int64, _ []*held) {
	from = resetTo
	if at, ok := p.commitPoint(); ok {
		from = min(from, at)
	} else if p.backHead < len(p.backlog) {
		from = min(from, p.backlog[p.backHead].Offset)
	}
	s.tel.rewinds.Add(context.Background(), 1, s.tel.partAttrs(p))
	s.dropBacklogLocked(p)
	lose = append(lose, s.fenceLocked([]*partition{p})...)

	s.epoch++
	np = newPartition(p.topic, p.id, s.epoch)
	np.committed, np.hwm, np.hwmAt, np.paused = p.committed, p.hwm, p.hwmAt, p.paused
	np.lastPolled = from - 1
	// The tracker is empty, so the commit point is the base until records
	// are done.
	np.hasTracked, np.base, np.lastTracked, np.dirty = true, from, from-1, true
	// Spans done by a previous owner stay valid below the reset point only.
	for _, sp := range p.skip {
		if sp.from >= resetTo {
			break
		}
		sp.to = min(sp.to, resetTo-1)
		np.skip = append(np.skip, sp)
	}
	s.parts[tpKey{p.topic, p.id}] = np
	s.rebuildOrderLocked()
	notify(s.commitSoon) // the group's commit may point past the replaced records
	return np, from, lose
}
