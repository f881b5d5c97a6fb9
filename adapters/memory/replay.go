package memory

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/pace"
)

// Replay lists the dead letters of a memory queue and moves a selection of
// them back to the queues they came from. Create it with [Broker.Replay].
// Its methods are safe for concurrent use.
type Replay struct {
	b     *Broker
	queue string
}

// Replay returns a Replay of the dead letters in the named queue, which
// must exist: messages written there by a [DeadLetterQueue] or moved there
// by a queue's MaxReceiveCount, each naming its original queue in the
// adapters.HeaderOriginalQueue header.
func (b *Broker) Replay(deadLetterQueue string) (*Replay, error) {
	if _, ok := b.lookup(deadLetterQueue); !ok {
		return nil, fmt.Errorf("memory: Replay(%q): %w", deadLetterQueue, ErrNoQueue)
	}
	return &Replay{b: b, queue: deadLetterQueue}, nil
}

// List returns up to max of the queue's dead letters, in the order they
// were written, with their diagnostics; a dry run: it changes nothing (no
// receive is counted). It lists the dead letters a consumer of the queue
// holds too, which Replay leaves alone.
func (r *Replay) List(ctx context.Context, max int) ([]adapters.DeadLetterRecord, error) {
	if max < 1 {
		return nil, fmt.Errorf("memory: Replay.List(max=%d): max must be at least 1", max)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	r.b.mu.Lock()
	defer r.b.mu.Unlock()
	q, ok := r.b.queues[r.queue]
	if !ok {
		return nil, fmt.Errorf("memory: Replay.List: queue %q: %w", r.queue, ErrNoQueue)
	}
	all := q.messages()
	out := make([]adapters.DeadLetterRecord, 0, min(max, len(all)))
	for _, m := range all[:min(max, len(all))] {
		out = append(out, deadLetterRecord(m))
	}
	return out, nil
}

// Replay moves the queue's dead letters that o selects, up to o.Max, back
// to their original queues, at most o.Rate a second, in the order they were
// written (so a FIFO group's dead letters go back in their order). Each
// goes back with its ID, body and key, its headers without the diagnostics,
// and adapters.HeaderReplayOf set to its ID (with the diagnostics packed
// into adapters.HeaderReplayDiagnostics when o.KeepDiagnostics). The copy
// and the removal from the dead-letter queue are one step under the
// broker's lock: a replay cut short at any point has moved each dead letter
// either whole or not at all, so running it again neither loses nor
// duplicates one.
//
// Dead letters a consumer of the queue holds are left alone. A dead letter
// naming no original queue, or one that does not exist, stops the replay
// with an error (those moved before stay moved); leave such dead letters
// out with o.Select.
func (r *Replay) Replay(ctx context.Context, o adapters.ReplayOptions) (adapters.ReplayResult, error) {
	var res adapters.ReplayResult
	p, err := pace.ForReplay(o.Rate, o.Max)
	if err != nil {
		return res, fmt.Errorf("memory: Replay: %w", err)
	}
	r.b.mu.Lock()
	q, ok := r.b.queues[r.queue]
	if !ok {
		r.b.mu.Unlock()
		return res, fmt.Errorf("memory: Replay: queue %q: %w", r.queue, ErrNoQueue)
	}
	q.promote(time.Now())
	pending := append([]*message(nil), q.ready...)
	r.b.mu.Unlock()
	sortBySeq(pending)

	for _, m := range pending {
		if o.Max > 0 && res.Replayed >= o.Max {
			break
		}
		r.b.mu.Lock()
		q.promote(time.Now())
		if m.deleted || !m.ready {
			r.b.mu.Unlock() // moved or received since: not ours to move
			continue
		}
		rec := deadLetterRecord(m)
		r.b.mu.Unlock()
		if o.Select != nil && !o.Select(rec) {
			res.Skipped++
			continue
		}
		if err := p.Wait(ctx); err != nil {
			return res, err
		}
		moved, err := r.move(q, m, rec, o.KeepDiagnostics)
		if err != nil {
			return res, err
		}
		if moved {
			res.Replayed++
		}
	}
	return res, nil
}

// move puts a copy of dead letter m (read as rec) on its original queue and
// removes m from the dead-letter queue q, in one step. It reports false when
// m is no longer there to move.
func (r *Replay) move(q *queue, m *message, rec adapters.DeadLetterRecord, keep bool) (bool, error) {
	headers := make(map[string]string, len(rec.Headers)+2)
	for k, v := range rec.Headers {
		if k != adapters.HeaderReplayOf && k != adapters.HeaderReplayDiagnostics {
			headers[k] = v
		}
	}
	headers[adapters.HeaderReplayOf] = rec.ID
	if keep {
		js, err := json.Marshal(rec.Diagnostics)
		if err != nil {
			return false, fmt.Errorf("memory: Replay: packing the diagnostics of dead letter %s: %w", rec.ID, err)
		}
		headers[adapters.HeaderReplayDiagnostics] = string(js)
	}
	r.b.mu.Lock()
	defer r.b.mu.Unlock()
	q.promote(time.Now())
	if m.deleted || !m.ready {
		return false, nil
	}
	if rec.OriginalQueue == "" {
		return false, fmt.Errorf("memory: Replay: dead letter %s in queue %q names no original queue (no %s header); leave it out with ReplayOptions.Select",
			rec.ID, r.queue, adapters.HeaderOriginalQueue)
	}
	dst, ok := r.b.queues[rec.OriginalQueue]
	if !ok {
		return false, fmt.Errorf("memory: Replay: the original queue %q of dead letter %s: %w (create it again, or leave the dead letter out with ReplayOptions.Select)",
			rec.OriginalQueue, rec.ID, ErrNoQueue)
	}
	q.remove(m)
	m.deleted = true
	q.noteIfEmpty()
	// A keyless copy for a FIFO queue gets its ID as its group
	// (publishLocked), as a dead-letter copy does.
	r.b.publishLocked(dst, Message{ID: m.id, Body: bytes.Clone(m.body), Headers: headers, Key: rec.Key}, time.Now())
	return true, nil
}

// deadLetterRecord reads a dead letter of a memory queue. The caller holds
// the broker's lock.
func deadLetterRecord(m *message) adapters.DeadLetterRecord {
	rec := adapters.DeadLetterRecord{ID: m.id, Body: bytes.Clone(m.body)}
	adapters.ReadDeadLetter(&rec, m.headers)
	switch {
	case rec.Key != "":
		// The original key, from the diagnostics.
	case rec.Diagnostics[adapters.HeaderPermanent] != "":
		// Written by a DeadLetterQueue, which records a key whenever the
		// original had one: this one had none (a FIFO dead-letter queue
		// gave the copy its ID as a group).
	default:
		// Moved by MaxReceiveCount, which keeps the key as it was.
		rec.Key = m.key
	}
	return rec
}
