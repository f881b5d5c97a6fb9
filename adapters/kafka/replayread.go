package kafka

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// replaySpan is what is left of one partition of the dead-letter topic for
// a run: from the replay group's committed offset (or the log start) up to
// end, the last stable offset when the run began.
type replaySpan struct {
	from, end int64
}

// plan returns, by partition of the dead-letter topic, the non-empty spans
// between the replay group's committed offsets (or the log start, where
// nothing is committed or the commit lies below it) and the partitions'
// last stable offsets now: a run reads committed records only.
func (r *Replay) plan(ctx context.Context) (map[int32]replaySpan, error) {
	adm := kadm.NewClient(r.cl)
	ends, err := adm.ListCommittedOffsets(ctx, r.topic)
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("listing the end offsets of %q: %w", r.topic, err)
	}
	starts, err := adm.ListStartOffsets(ctx, r.topic)
	if err == nil {
		err = starts.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("listing the start offsets of %q: %w", r.topic, err)
	}
	committed, err := adm.FetchOffsets(ctx, r.group)
	if err != nil && !errors.Is(err, kerr.GroupIDNotFound) {
		return nil, fmt.Errorf("fetching the offsets of replay group %q: %w", r.group, err)
	}
	if err := committed.Error(); err != nil {
		return nil, fmt.Errorf("fetching the offsets of replay group %q: %w", r.group, err)
	}
	plan := map[int32]replaySpan{}
	for part, end := range ends[r.topic] {
		from := int64(0)
		if st, ok := starts.Lookup(r.topic, part); ok {
			from = st.Offset
		}
		if c, ok := committed.Lookup(r.topic, part); ok && c.At >= 0 {
			from = max(from, c.At)
		}
		if from < end.Offset {
			plan[part] = replaySpan{from: from, end: end.Offset}
		}
	}
	return plan, nil
}

// readDeadLetter reads a record of the dead-letter topic as
// adapters.ReadDeadLetter does, its ID "topic/partition/offset". The
// HeaderGroup header the DeadLetter adds is a diagnostic too.
func readDeadLetter(rec *kgo.Record) adapters.DeadLetterRecord {
	dl := adapters.DeadLetterRecord{
		ID:   rec.Topic + "/" + strconv.Itoa(int(rec.Partition)) + "/" + strconv.FormatInt(rec.Offset, 10),
		Body: rec.Value,
		Key:  string(rec.Key),
	}
	headers := make(map[string]string, len(rec.Headers))
	for _, h := range rec.Headers {
		headers[h.Key] = string(h.Value)
	}
	group, hasGroup := headers[HeaderGroup]
	delete(headers, HeaderGroup)
	adapters.ReadDeadLetter(&dl, headers)
	if hasGroup {
		dl.Diagnostics[HeaderGroup] = group
	}
	return dl
}

// replayCopy builds the record that replays dead letter rec (read as dl),
// as Replay.Replay describes it. Headers are copied as written (repeated
// keys and binary values too).
func replayCopy(rec *kgo.Record, dl adapters.DeadLetterRecord, keep bool) (*kgo.Record, error) {
	if dl.OriginalQueue == "" {
		return nil, fmt.Errorf("it names no original topic (no %s header: not written by a custody dead-letter sink); leave it out with ReplayOptions.Select",
			adapters.HeaderOriginalQueue)
	}
	out := &kgo.Record{Topic: dl.OriginalQueue, Key: rec.Key, Value: rec.Value}
	for _, h := range rec.Headers {
		if adapters.IsDiagnosticHeader(h.Key) || h.Key == HeaderGroup {
			continue
		}
		out.Headers = append(out.Headers, h)
	}
	out.Headers = append(out.Headers, kgo.RecordHeader{Key: adapters.HeaderReplayOf, Value: []byte(dl.ID)})
	if keep {
		js, err := json.Marshal(dl.Diagnostics)
		if err != nil {
			return nil, fmt.Errorf("packing its diagnostics: %w", err)
		}
		out.Headers = append(out.Headers, kgo.RecordHeader{Key: adapters.HeaderReplayDiagnostics, Value: js})
	}
	return out, nil
}
