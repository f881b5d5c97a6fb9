package awssqs

import (
	"context"

	"github.com/custody-go/custody/adapters"
)

// maxPoison bounds the ids remembered by rememberPoison.
const maxPoison = 4096

// rememberPoison records that a message was handed to the redrive policy
// before SQS's receive count allows moving it (a permanent error). When this
// Source receives it again it releases it at once, without running the
// handler, until SQS moves it.
func (s *Source) rememberPoison(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.poison == nil {
		s.poison = make(map[string]struct{})
	}
	if len(s.poison) >= maxPoison {
		for k := range s.poison { // forget an arbitrary one; worst case it runs again
			delete(s.poison, k)
			break
		}
	}
	s.poison[id] = struct{}{}
}

// filterPoison removes remembered poison messages from ds and returns them
// separately. Once a message reaches maxReceiveCount its next receive moves
// it, so it is forgotten.
func (s *Source) filterPoison(ds []*adapters.Delivery) (keep, poison []*adapters.Delivery) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.poison) == 0 {
		return ds, nil
	}
	keep = ds[:0]
	for _, d := range ds {
		if _, ok := s.poison[d.ID]; ok {
			if s.redrive == nil || d.Attempt >= s.redrive.MaxReceiveCount {
				delete(s.poison, d.ID)
			}
			poison = append(poison, d)
			continue
		}
		keep = append(keep, d)
	}
	return keep, poison
}

// releasePoison gives poison messages straight back to SQS.
func (s *Source) releasePoison(ds []*adapters.Delivery) {
	if len(ds) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.opts.requestTimeout)
	defer cancel()
	// A failure only keeps them away until their visibility timeout runs out.
	_ = s.changeVisibility(ctx, ds, make([]int32, len(ds)), nil)
}
