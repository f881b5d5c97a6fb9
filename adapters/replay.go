package adapters

import (
	"sort"
	"strconv"
	"time"
)

// Headers a replayed message carries: the ID of the dead letter it was
// replayed from, so that a replay run twice (or cut short and run again)
// can tell what it already moved, and, on request, the dead letter's
// diagnostics packed in one header.
const (
	HeaderReplayOf          = "custody-replay-of"
	HeaderReplayDiagnostics = "custody-replay-diagnostics"
)

// DeadLetterRecord is one message found at a dead-letter destination,
// read back with the diagnostics the runtime wrote beside it (see
// Diagnostics).
type DeadLetterRecord struct {
	// ID identifies the dead letter at its destination (an SQS message
	// id, a Kafka topic/partition/offset): what a replay is deduplicated
	// by.
	ID string
	// Body and Headers are the original message's, without the
	// diagnostics; Key is its key (a FIFO group, a Kafka record key).
	Body    []byte
	Headers map[string]string
	Key     string
	// The diagnostics.
	OriginalQueue string
	OriginalID    string
	Partition     int32 // -1 when not applicable
	Offset        int64 // -1 when not applicable
	Error         string
	Permanent     bool
	Attempts      int
	FirstFailure  time.Time
	LastFailure   time.Time
	Consumer      string
	// Diagnostics are the diagnostic headers as written.
	Diagnostics map[string]string
}

// ReadDeadLetter splits the headers of a dead letter into the original
// headers and the diagnostics, and fills rec's diagnostic fields. It
// reports false when the headers hold no diagnostics (not a dead letter
// the runtime wrote).
func ReadDeadLetter(rec *DeadLetterRecord, headers map[string]string) bool {
	rec.Headers = make(map[string]string, len(headers))
	rec.Diagnostics = make(map[string]string)
	rec.Partition, rec.Offset = -1, -1
	for k, v := range headers {
		if IsDiagnosticHeader(k) {
			rec.Diagnostics[k] = v
		} else {
			rec.Headers[k] = v
		}
	}
	d := rec.Diagnostics
	rec.OriginalQueue = d[HeaderOriginalQueue]
	rec.OriginalID = d[HeaderOriginalID]
	rec.Error = d[HeaderError]
	rec.Permanent = d[HeaderPermanent] == "true"
	rec.Attempts, _ = strconv.Atoi(d[HeaderAttempts])
	rec.Consumer = d[HeaderConsumer]
	if k, ok := d[HeaderOriginalKey]; ok && rec.Key == "" {
		rec.Key = k
	}
	if p, err := strconv.ParseInt(d[HeaderOriginalPart], 10, 32); err == nil {
		rec.Partition = int32(p)
	}
	if o, err := strconv.ParseInt(d[HeaderOriginalOffset], 10, 64); err == nil {
		rec.Offset = o
	}
	rec.FirstFailure, _ = time.Parse(diagnosticTimeLayout, d[HeaderFirstFailure])
	rec.LastFailure, _ = time.Parse(diagnosticTimeLayout, d[HeaderLastFailure])
	return len(rec.Diagnostics) > 0
}

// DeadLetterGroup is the dead letters of one error, consumer and hour
// (of their last failure), for a dry run to show before a replay.
type DeadLetterGroup struct {
	Error    string
	Consumer string
	Hour     time.Time
	Count    int
	// IDs are the dead letters' IDs, in the order read.
	IDs []string
}

// GroupDeadLetters groups recs by error text, consumer and the hour of
// their last failure, the largest groups first.
func GroupDeadLetters(recs []DeadLetterRecord) []DeadLetterGroup {
	type key struct {
		err, consumer string
		hour          time.Time
	}
	idx := map[key]int{}
	var groups []DeadLetterGroup
	for _, r := range recs {
		k := key{r.Error, r.Consumer, r.LastFailure.UTC().Truncate(time.Hour)}
		i, ok := idx[k]
		if !ok {
			i = len(groups)
			idx[k] = i
			groups = append(groups, DeadLetterGroup{Error: k.err, Consumer: k.consumer, Hour: k.hour})
		}
		groups[i].Count++
		groups[i].IDs = append(groups[i].IDs, r.ID)
	}
	sort.SliceStable(groups, func(a, b int) bool { return groups[a].Count > groups[b].Count })
	return groups
}

// ReplayOptions says what a replay moves back and how.
type ReplayOptions struct {
	// Select picks the dead letters to replay; nil picks every one.
	Select func(DeadLetterRecord) bool
	// Rate bounds the messages replayed per second; zero means 10.
	Rate float64
	// Max bounds the messages replayed; zero means no bound.
	Max int
	// KeepDiagnostics keeps the dead letter's diagnostics on the replayed
	// message, packed into HeaderReplayDiagnostics; by default they are
	// stripped (the message goes back as it was published).
	KeepDiagnostics bool
}

// ReplayResult counts what a replay did.
type ReplayResult struct {
	// Replayed is the dead letters copied back to their original queue or
	// topic and removed from the dead-letter destination.
	Replayed int
	// Skipped is those Select left out, and those found replayed before
	// (their copy confirmed, their removal cut short): removed without a
	// second copy.
	Skipped int
}
