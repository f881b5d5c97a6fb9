package kafka

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/pace"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

const (
	// defaultReplayRate is the rate when ReplayOptions.Rate is zero, as
	// package adapters documents it.
	defaultReplayRate = 10
	// replayPollWait bounds one poll of a run: a partition whose remaining
	// offsets hold no record a fetch returns (all of them in aborted
	// transactions) is polled again after it.
	replayPollWait = time.Second
	// replayTxnSpan bounds, at the run's rate, the copies of one
	// transaction: a few seconds of copies, far below the transaction
	// timeout (kgo.TransactionTimeout, 40s by default).
	replayTxnSpan = 5 * time.Second
	// maxReplayBatch bounds the records one transaction covers.
	maxReplayBatch = 500
)

// Replay lists the dead letters of a dead-letter topic and moves a
// selection of them back to the topics they came from. Create it with
// [NewReplay]. Its methods may be called from any goroutine; a Replay runs
// one List or Replay at a time.
//
// Kafka deletes no record on request: a replay's progress is the offsets of
// a consumer group of its own on the dead-letter topic, the replay group
// (WithGroup). What it looked at, replayed or left out, is behind them;
// List and Replay see what is beyond them. A new group starts at the
// topic's start.
type Replay struct {
	cfg   config
	cl    *kgo.Client // for metadata, offsets and List's reads
	topic string
	group string
	txnID string

	txnSpan time.Duration // replayTxnSpan; tests shorten it

	mu sync.Mutex // one call at a time

	// testHookBeforeEnd, set by a test, runs before a transaction ends; an
	// error it returns ends the run at once, the transaction left open and
	// the session abandoned, as if the process died there.
	testHookBeforeEnd func(*kgo.GroupTransactSession) error
}

// errAbandon is what testHookBeforeEnd returns to abandon a run.
var errAbandon = errors.New("kafka: replay abandoned (test)")

// NewReplay returns a Replay of dead-letter topic topic, and reaches the
// cluster within ctx: it fails, with the cause, when no broker answers or
// the topic does not exist. WithBrokers is required, and so is WithGroup:
// the replay group (see [Replay]), not the group of the consumer that
// dead-lettered the records. WithClientOptions (TLS, SASL) and WithLogger
// apply, and WithClientFactory to the client List reads with; a Source's
// other options are refused. Close it when done.
//
// A run's client is transactional, with the transactional ID
// "custody-replay-" followed by the group: consumers of the original
// topics must read committed records only
// (kgo.FetchIsolationLevel(kgo.ReadCommitted())) not to see the aborted
// copies of a run cut short. The principal needs to read the topic, to
// read and commit the group's offsets, to write the original topics, and
// to use its transactional ID.
func NewReplay(ctx context.Context, topic string, opts ...Option) (*Replay, error) {
	if topic == "" {
		return nil, errors.New("kafka: NewReplay: the dead-letter topic must not be empty")
	}
	cfg, err := clientConfig("NewReplay", opts)
	if err != nil {
		return nil, err
	}
	if cfg.group == "" {
		return nil, errors.New("kafka: NewReplay: WithGroup is required: name the replay group, whose offsets on the dead-letter topic record what was replayed (not the group of the consumer that dead-lettered the records)")
	}
	cl, err := cfg.connect(ctx, "NewReplay: ", cfg.kgoOpts(newConnWatch(cfg.logger, "dead-letter replay of topic "+topic)))
	if err != nil {
		return nil, err
	}
	if err := checkTopic(ctx, cl, topic); err != nil {
		cl.Close()
		return nil, fmt.Errorf("kafka: NewReplay: %w", err)
	}
	return &Replay{cfg: cfg, cl: cl, topic: topic, group: cfg.group, txnID: "custody-replay-" + cfg.group, txnSpan: replayTxnSpan}, nil
}

// Close closes the Replay's client.
func (r *Replay) Close() error {
	r.cl.Close()
	return nil
}

// List returns up to max of the dead letters beyond the replay group's
// offsets, partition by partition (the topic's first partition first),
// with their diagnostics: a dry run, which joins no group and commits
// nothing. It reads committed records only, up to the ends the partitions
// have when it begins. max must be at least 1.
func (r *Replay) List(ctx context.Context, max int) ([]adapters.DeadLetterRecord, error) {
	if max < 1 {
		return nil, fmt.Errorf("kafka: Replay.List(max=%d): max must be at least 1", max)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	plan, err := r.plan(ctx)
	if err != nil {
		return nil, fmt.Errorf("kafka: Replay.List of topic %q: %w", r.topic, err)
	}
	if len(plan) == 0 {
		return nil, nil
	}
	from := map[int32]kgo.Offset{}
	for part, sp := range plan {
		from[part] = kgo.NewOffset().At(sp.from)
	}
	cl, err := r.cfg.factory(r.cfg.kgoOpts(newConnWatch(r.cfg.logger, "dead-letter listing of topic "+r.topic),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{r.topic: from}),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.KeepControlRecords(),
	)...)
	if err != nil {
		return nil, fmt.Errorf("kafka: Replay.List: creating the client: %w", err)
	}
	defer cl.Close()
	byPart := map[int32][]adapters.DeadLetterRecord{}
	found := 0
	for len(plan) > 0 && found < max {
		pctx, cancel := context.WithTimeout(ctx, replayPollWait)
		fs := cl.PollFetches(pctx)
		cancel()
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if err := fetchError(fs); err != nil {
			return nil, fmt.Errorf("kafka: Replay.List: %w", err)
		}
		fs.EachRecord(func(rec *kgo.Record) {
			sp, ok := plan[rec.Partition]
			if !ok {
				return
			}
			if rec.Offset >= sp.end {
				delete(plan, rec.Partition)
				return
			}
			if rec.Offset+1 >= sp.end {
				delete(plan, rec.Partition)
			}
			if rec.Attrs.IsControl() || found == max {
				return
			}
			byPart[rec.Partition] = append(byPart[rec.Partition], readDeadLetter(rec))
			found++
		})
	}
	var out []adapters.DeadLetterRecord
	for _, p := range slices.Sorted(maps.Keys(byPart)) {
		out = append(out, byPart[p]...)
	}
	return out, nil
}

// Replay copies the dead letters beyond the replay group's offsets that o
// selects, up to o.Max, back to their original topics (the
// custody-original-queue diagnostic), at most o.Rate a second (10 by
// default), and advances the group past every dead letter it looked at, in
// one Kafka transaction per batch: the copies and the group's new offsets
// are committed together, or neither is. A run reads committed records
// only, up to the ends the partitions have when it begins, so a copy
// dead-lettered again during the run is not replayed again by it.
//
// The copy is the dead letter's key, value and headers, without the
// diagnostics (an earlier replay's headers included), with adapters.HeaderReplayOf set to the dead letter's ID
// (topic/partition/offset in the dead-letter topic), and with
// o.KeepDiagnostics the diagnostics as a JSON object in
// adapters.HeaderReplayDiagnostics. Its unchanged key takes it to the
// partition of the key's later records (given the same partition count).
//
// A run advances the group, past the dead letters o.Select leaves out too
// (counted as Skipped): a later run of the group does not see them again.
// To replay some of them later, use another group, which starts at the
// topic's start and sees the dead letters replayed under this one as well
// (select them out by ID: their copies carry HeaderReplayOf). A run that
// reaches o.Max stops at that dead letter; the next run starts there.
//
// A run stopped at any point (an error, ctx's end, a crash) loses no dead
// letter and, for consumers that read committed records only, copies none
// twice: a transaction cut short is aborted (by the next run, which takes
// over the transactional ID, or by the transaction timeout), so its copies
// never become visible to them, its offsets never count, and the next run
// copies those dead letters again. A run stops at the first error: a dead
// letter that names no original topic (the dead letters before it are
// committed; it and those after it stay), a copy the brokers refuse,
// another run of the same group (which fences this one), ctx's end. Run
// one replay of a group at a time.
func (r *Replay) Replay(ctx context.Context, o adapters.ReplayOptions) (adapters.ReplayResult, error) {
	var res adapters.ReplayResult
	switch {
	case !(o.Rate >= 0): // negative, or NaN
		return res, fmt.Errorf("kafka: Replay: ReplayOptions.Rate %v must not be negative (zero means %d a second)", o.Rate, defaultReplayRate)
	case o.Max < 0:
		return res, errors.New("kafka: Replay: ReplayOptions.Max must not be negative (zero means no bound)")
	}
	rate := o.Rate
	if rate == 0 {
		rate = defaultReplayRate
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	run := &replayRun{r: r, o: o, p: pace.New(rate)}
	run.batch = int(min(maxReplayBatch, max(1, rate*r.txnSpan.Seconds())))
	err := run.do(ctx)
	if err != nil {
		err = fmt.Errorf("kafka: Replay of topic %q to group %q (%d replayed before): %w", r.topic, r.group, run.res.Replayed, err)
	}
	return run.res, err
}

// replayRun is one call of Replay.
type replayRun struct {
	r     *Replay
	o     adapters.ReplayOptions
	p     *pace.Pacer
	batch int
	res   adapters.ReplayResult
	// plan is what is left to look at, by partition; a partition leaves it
	// once a committed transaction reached its end.
	plan map[int32]replaySpan
}

func (run *replayRun) do(ctx context.Context) error {
	r := run.r
	sess, err := kgo.NewGroupTransactSession(r.cfg.kgoOpts(newConnWatch(r.cfg.logger, "dead-letter replay of topic "+r.topic),
		kgo.TransactionalID(r.txnID),
		kgo.ConsumerGroup(r.group),
		kgo.ConsumeTopics(r.topic),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.KeepControlRecords(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.ProducerLinger(0),
	)...)
	if err != nil {
		return fmt.Errorf("creating the transactional client: %w", err)
	}
	abandoned := false
	defer func() {
		if !abandoned {
			sess.Close()
		}
	}()
	// Taking over the transactional ID fences a run cut short and aborts
	// its open transaction: only then do the group's offsets hold.
	if _, _, err := sess.Client().ProducerID(ctx); err != nil {
		return fmt.Errorf("initialising transactional ID %q: %w", r.txnID, err)
	}
	if run.plan, err = r.plan(ctx); err != nil {
		return err
	}
	for len(run.plan) > 0 && (run.o.Max == 0 || run.res.Replayed < run.o.Max) {
		if err := run.p.Ready(ctx); err != nil {
			return err
		}
		if err := sess.Begin(); err != nil {
			return fmt.Errorf("beginning a transaction: %w", err)
		}
		err := run.batchOnce(ctx, sess)
		if errors.Is(err, errAbandon) {
			abandoned = true
			return err
		}
		if err != nil {
			actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.commitTimeout)
			_, _ = sess.End(actx, kgo.TryAbort)
			cancel()
			return err
		}
	}
	return nil
}

// position is where a transaction moves a partition of the group.
type position struct {
	offset int64
	epoch  int32
}

// batchOnce polls the next records of the dead-letter topic, copies those
// selected in the open transaction, and ends it, committing the copies with
// the group's offsets past every record looked at.
func (run *replayRun) batchOnce(ctx context.Context, sess *kgo.GroupTransactSession) error {
	r := run.r
	n := run.batch
	if run.o.Max > 0 {
		n = min(n, run.o.Max-run.res.Replayed)
	}
	pctx, cancel := context.WithTimeout(ctx, replayPollWait)
	fs := sess.PollRecords(pctx, n)
	cancel()
	if err := ctx.Err(); err != nil {
		return err
	}
	if fs.IsClientClosed() {
		return adapters.ErrClosed
	}
	if err := fetchError(fs); err != nil {
		return err
	}
	var (
		moved   = map[int32]position{}
		reached = map[int32]bool{} // partitions whose end a record reached
		copies  int
		skipped int
		full    bool
		err     error
		// stop is a dead letter that cannot be copied: the run stops at
		// it, once the transaction has committed those before it.
		stop error
	)
	fs.EachRecord(func(rec *kgo.Record) {
		sp, ok := run.plan[rec.Partition]
		if err != nil || full || !ok || rec.Topic != r.topic {
			return
		}
		if rec.Offset >= sp.end { // left for the next run
			reached[rec.Partition] = true
			return
		}
		if !rec.Attrs.IsControl() {
			dl := readDeadLetter(rec)
			if run.o.Select != nil && !run.o.Select(dl) {
				skipped++
			} else {
				cp, cerr := replayCopy(rec, dl, run.o.KeepDiagnostics)
				if cerr != nil {
					stop, full = fmt.Errorf("dead letter %s stays: %w", dl.ID, cerr), true
					return
				}
				if err = run.p.Wait(ctx); err != nil {
					return
				}
				if err = sess.ProduceSync(ctx, cp).FirstErr(); err != nil {
					err = fmt.Errorf("copying dead letter %s to topic %q (it stays): %w", dl.ID, cp.Topic, err)
					return
				}
				copies++
				full = run.o.Max > 0 && run.res.Replayed+copies >= run.o.Max
			}
		}
		moved[rec.Partition] = position{offset: rec.Offset + 1, epoch: rec.LeaderEpoch}
		if rec.Offset+1 >= sp.end {
			reached[rec.Partition] = true
		}
	})
	if err != nil {
		return err
	}
	if r.testHookBeforeEnd != nil {
		if err := r.testHookBeforeEnd(sess); err != nil {
			return err
		}
	}
	if len(moved) == 0 { // nothing looked at: nothing to commit
		if _, err := sess.End(ctx, kgo.TryAbort); err != nil {
			return fmt.Errorf("ending an empty transaction: %w", err)
		}
		for part := range reached {
			delete(run.plan, part)
		}
		return stop
	}
	// The session would commit every record polled; the group moves past
	// the records looked at only (not those beyond the run's end, nor
	// those polled after Max was reached).
	ectx := kgo.PreTxnCommitFnContext(ctx, func(req *kmsg.TxnOffsetCommitRequest) error {
		topics := req.Topics[:0]
		for _, t := range req.Topics {
			parts := t.Partitions[:0]
			for _, p := range t.Partitions {
				if pos, ok := moved[p.Partition]; ok && t.Topic == r.topic {
					p.Offset, p.LeaderEpoch = pos.offset, pos.epoch
					parts = append(parts, p)
				}
			}
			if len(parts) > 0 {
				t.Partitions = parts
				topics = append(topics, t)
			}
		}
		req.Topics = topics
		return nil
	})
	committed, err := sess.End(ectx, kgo.TryCommit)
	if err != nil {
		return fmt.Errorf("committing the transaction of %d copies (they are aborted; their dead letters stay): %w", copies, err)
	}
	if !committed {
		// The group rebalanced meanwhile: the transaction was aborted, and
		// the session polls again from the group's offsets.
		return stop
	}
	run.res.Replayed += copies
	run.res.Skipped += skipped
	for part, pos := range moved {
		sp := run.plan[part]
		sp.from = pos.offset
		run.plan[part] = sp
	}
	for part := range reached {
		delete(run.plan, part)
	}
	return stop
}
