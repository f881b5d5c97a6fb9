package kafka

import (
	"context"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// pendingCommit is one partition's commit, built under Source.mu.
type pendingCommit struct {
	p      *partition
	offset int64
	epoch  int32 // leader epoch of the last record committed, -1 if unknown
	meta   string
}

// commitLoop commits a linger after records are marked done, on the commit
// interval, and when asked through commitSoon, until Close, one commit at a
// time. After a failed commit, marks wait for the next tick: a coordinator
// refusing commits gets one a commit interval, not one per linger.
func (s *Source) commitLoop() {
	defer close(s.loopDone)
	t := time.NewTicker(s.cfg.commitInterval)
	defer t.Stop()
	linger := time.NewTimer(s.cfg.commitLinger)
	linger.Stop()
	failed := false
	for {
		select {
		case <-s.stopLoop:
			return
		case <-t.C:
		case <-s.commitSoon:
		case <-s.marked:
			if failed {
				continue // the next tick commits these too
			}
			if s.cfg.commitLinger > 0 { // let more acks come, for one request
				linger.Reset(s.cfg.commitLinger)
				select {
				case <-s.stopLoop:
					linger.Stop()
					return // Close commits
				case <-linger.C:
				case <-s.commitSoon:
					linger.Stop()
				}
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.commitTimeout)
		err := s.commit(ctx, nil) // failures are counted
		cancel()
		failed = err != nil
	}
}

// notify signals ch without blocking: a signal pending already stands for
// this one too.
func notify(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// Commit commits the done prefixes of every assigned partition now. Most
// programs never need it.
func (s *Source) Commit(ctx context.Context) error { return s.commit(ctx, nil) }

// commit commits the given partitions (all assigned ones when ps is nil).
func (s *Source) commit(ctx context.Context, ps []*partition) error {
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	s.mu.Lock()
	if ps == nil {
		ps = s.order
	}
	pcs := s.snapshotLocked(ps)
	s.mu.Unlock()
	return s.send(ctx, pcs)
}

// snapshotLocked builds the commits of the partitions with news since their
// last commit, skipping fenced ones: a fenced partition is never committed.
func (s *Source) snapshotLocked(ps []*partition) []pendingCommit {
	var pcs []pendingCommit
	for _, p := range ps {
		if p.fenced || !p.dirty {
			continue
		}
		at, ok := p.commitPoint()
		if !ok {
			continue
		}
		p.dirty = false
		pcs = append(pcs, pendingCommit{p: p, offset: at, epoch: p.leaderEpochBefore(at), meta: p.metadata(at, s.cfg.metadataLimit)})
	}
	return pcs
}

// send issues one synchronous commit for pcs. The caller holds commitMu.
func (s *Source) send(ctx context.Context, pcs []pendingCommit) error {
	if len(pcs) == 0 {
		return nil
	}
	offsets := make(map[string]map[int32]kgo.EpochOffset)
	metas := make(map[tpKey]*string, len(pcs))
	for i := range pcs {
		pc := &pcs[i]
		if offsets[pc.p.topic] == nil {
			offsets[pc.p.topic] = make(map[int32]kgo.EpochOffset)
		}
		offsets[pc.p.topic][pc.p.id] = kgo.EpochOffset{Epoch: pc.epoch, Offset: pc.offset}
		metas[tpKey{pc.p.topic, pc.p.id}] = &pc.meta
	}
	ctx = kgo.PreCommitFnContext(ctx, func(req *kmsg.OffsetCommitRequest) error {
		for i := range req.Topics {
			t := &req.Topics[i]
			for j := range t.Partitions {
				if m := metas[tpKey{t.Topic, t.Partitions[j].Partition}]; m != nil {
					t.Partitions[j].Metadata = m
				}
			}
		}
		return nil
	})
	start := time.Now()
	var err error
	failed := make(map[tpKey]error)
	s.cl.CommitOffsetsSync(ctx, offsets, func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, cerr error) {
		if cerr != nil {
			err = cerr
			return
		}
		for _, t := range resp.Topics {
			for _, pt := range t.Partitions {
				if e := kerr.ErrorForCode(pt.ErrorCode); e != nil {
					failed[tpKey{t.Topic, pt.Partition}] = e
				}
			}
		}
	})
	s.tel.commitDone(time.Since(start), err != nil || len(failed) > 0)

	s.mu.Lock()
	for _, pc := range pcs {
		perr := err
		if perr == nil {
			perr = failed[tpKey{pc.p.topic, pc.p.id}]
		}
		if perr != nil {
			pc.p.dirty = true // try again on the next tick, unless fenced by then
			continue
		}
		// What was sent is what the group holds now, even below the old
		// commit (a rewound partition's new epoch): commitMu orders the
		// commits, and an epoch's commit point only grows.
		pc.p.committed = pc.offset
	}
	s.mu.Unlock()
	if err != nil {
		return fmt.Errorf("kafka: committing offsets: %w", err)
	}
	for k, e := range failed {
		return fmt.Errorf("kafka: committing %s/%d: %w", k.topic, k.part, e)
	}
	return nil
}
