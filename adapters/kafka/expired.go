package kafka

import (
	"context"
	"errors"
	"fmt"
)

// ErrExpired is wrapped by the error Receive returns when a partition's
// committed offset is below its log start: retention (or DeleteRecords)
// removed records before the group read them, and franz-go resumed at the
// log start (or wherever kgo.ConsumeResetOffset points). Those records are
// gone for the group; the error names the partition and the offsets.
var ErrExpired = errors.New("kafka: records were deleted before the group read them")

// expiredLocked checks the first records fetched for p in its assignment
// against the committed offset it started from, and reports (and counts in
// custody.kafka.expired) the offsets skipped because they were deleted. A
// gap above the log start is compaction's, which removes only records with
// newer values for their keys: that is no loss.
func (s *Source) expiredLocked(p *partition, first, logStart int64) error {
	if p.committed < 0 || first <= p.committed || logStart <= p.committed {
		return nil
	}
	n := first - p.committed
	s.tel.expired.Add(context.Background(), n, s.tel.partAttrs(p))
	return fmt.Errorf("%w: %s: offsets %d to %d (%d records) were never read: the committed offset %d is below the log start %d; resumed at %d. Raise the topic's retention or speed the group up",
		ErrExpired, p.lane, p.committed, first-1, n, p.committed, logStart, first)
}
