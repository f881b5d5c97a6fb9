package idempotency

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/custody-go/custody/internal/option"
)

// ErrMemoryStoreFull: every record in a MemoryStore is an unexpired
// in-progress claim, so there is no room for another one. Raise
// MemoryMaxEntries or lower the consumer's concurrency.
var ErrMemoryStoreFull = errors.New("idempotency: memory store is full of in-progress claims; raise MemoryMaxEntries")

// MemoryStore is a Store inside the process: for tests, for a single
// consumer process, and for deduplicating within one process in front of a
// shared store. It forgets everything when the process exits, so it cannot
// absorb duplicates that arrive after a restart or at another process.
//
// It is bounded: when it holds MemoryMaxEntries records it first drops
// expired ones, then the completed record closest to its expiry (forgetting
// a completed key early can let one late duplicate through; the eviction is
// counted by Evictions). It never evicts an unexpired in-progress claim.
type MemoryStore struct {
	mu         sync.Mutex
	max        int
	entries    map[string]*memEntry
	inProgress expiryHeap
	completed  expiryHeap
	evictions  uint64
	now        func() time.Time
}

var _ BatchStore = (*MemoryStore)(nil)

type memEntry struct {
	key         string
	token       Token
	done        bool
	fingerprint string
	expires     time.Time
	index       int // position in inProgress or completed, for heap.Remove
}

// MemoryOption configures a MemoryStore.
type MemoryOption func(*MemoryStore) error

// MemoryMaxEntries bounds the records a MemoryStore holds. Default 100,000.
// Must be at least 1.
func MemoryMaxEntries(n int) MemoryOption {
	return func(s *MemoryStore) error {
		if n < 1 {
			return fmt.Errorf("idempotency: MemoryMaxEntries(%d): must be at least 1", n)
		}
		s.max = n
		return nil
	}
}

// NewMemoryStore returns an empty MemoryStore.
func NewMemoryStore(opts ...MemoryOption) (*MemoryStore, error) {
	s := &MemoryStore{max: 100_000, entries: make(map[string]*memEntry), now: time.Now}
	if err := option.Apply(s, opts); err != nil {
		return nil, err
	}
	return s, nil
}

// Claim implements Store.
func (s *MemoryStore) Claim(ctx context.Context, key, fingerprint string, lease time.Duration) (st State, tok Token, err error) {
	err = s.one(ctx, checkDuration("lease", lease), func(now time.Time) error {
		st, tok, err = s.claim(now, key, fingerprint, lease)
		return err
	})
	return st, tok, err
}

// Complete implements Store.
func (s *MemoryStore) Complete(ctx context.Context, key string, token Token, retention time.Duration) error {
	return s.one(ctx, checkDuration("retention", retention), func(now time.Time) error {
		return s.complete(now, key, token, retention)
	})
}

// Release implements Store.
func (s *MemoryStore) Release(ctx context.Context, key string, token Token) error {
	return s.one(ctx, nil, func(now time.Time) error { return s.release(now, key, token) })
}

// Extend implements Store.
func (s *MemoryStore) Extend(ctx context.Context, key string, token Token, lease time.Duration) error {
	return s.one(ctx, checkDuration("lease", lease), func(now time.Time) error {
		return s.extend(now, key, token, lease)
	})
}

// one runs f under the lock, unless err (an invalid argument) or ctx's
// error fails it.
func (s *MemoryStore) one(ctx context.Context, err error, f func(time.Time) error) error {
	if err == nil {
		err = ctx.Err()
	}
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return f(s.now())
}

// ClaimBatch implements BatchStore.
func (s *MemoryStore) ClaimBatch(ctx context.Context, claims []ClaimRequest, lease time.Duration) []ClaimResult {
	res := make([]ClaimResult, len(claims))
	err := s.one(ctx, checkDuration("lease", lease), func(now time.Time) error {
		for i, c := range claims {
			res[i].State, res[i].Token, res[i].Err = s.claim(now, c.Key, c.Fingerprint, lease)
		}
		return nil
	})
	if err != nil {
		for i := range res {
			res[i].Err = err
		}
	}
	return res
}

// CompleteBatch implements BatchStore.
func (s *MemoryStore) CompleteBatch(ctx context.Context, held []HeldClaim, retention time.Duration) []error {
	return s.each(ctx, held, checkDuration("retention", retention), func(now time.Time, h HeldClaim) error {
		return s.complete(now, h.Key, h.Token, retention)
	})
}

// ReleaseBatch implements BatchStore.
func (s *MemoryStore) ReleaseBatch(ctx context.Context, held []HeldClaim) []error {
	return s.each(ctx, held, nil, func(now time.Time, h HeldClaim) error {
		return s.release(now, h.Key, h.Token)
	})
}

// ExtendBatch implements BatchStore.
func (s *MemoryStore) ExtendBatch(ctx context.Context, held []HeldClaim, lease time.Duration) []error {
	return s.each(ctx, held, checkDuration("lease", lease), func(now time.Time, h HeldClaim) error {
		return s.extend(now, h.Key, h.Token, lease)
	})
}

// each runs f for every claim of held under the lock, unless err (an
// invalid argument) or ctx's error fails them all.
func (s *MemoryStore) each(ctx context.Context, held []HeldClaim, err error, f func(time.Time, HeldClaim) error) []error {
	errs := make([]error, len(held))
	err = s.one(ctx, err, func(now time.Time) error {
		for i, h := range held {
			errs[i] = f(now, h)
		}
		return nil
	})
	if err != nil {
		for i := range errs {
			errs[i] = err
		}
	}
	return errs
}

// claim, complete, release and extend do the work of the Store methods
// with s.mu held.

func (s *MemoryStore) claim(now time.Time, key, fingerprint string, lease time.Duration) (State, Token, error) {
	if e := s.live(key, now); e != nil {
		if fingerprint != "" && e.fingerprint != "" && fingerprint != e.fingerprint {
			return 0, "", fmt.Errorf("%w (key %q)", ErrFingerprintMismatch, key)
		}
		if e.done {
			return Completed, "", nil
		}
		return InProgressElsewhere, "", nil
	}
	if len(s.entries) >= s.max && !s.makeRoom(now) {
		return 0, "", ErrMemoryStoreFull
	}
	e := &memEntry{key: key, token: NewToken(), fingerprint: fingerprint, expires: now.Add(lease)}
	s.entries[key] = e
	heap.Push(&s.inProgress, e)
	return Acquired, e.token, nil
}

func (s *MemoryStore) complete(now time.Time, key string, token Token, retention time.Duration) error {
	e := s.live(key, now)
	if e == nil || e.token != token {
		return staleErr(key)
	}
	if e.done {
		return nil // a repeated Complete by the same holder
	}
	heap.Remove(&s.inProgress, e.index)
	e.done = true
	e.expires = now.Add(retention)
	heap.Push(&s.completed, e)
	return nil
}

func (s *MemoryStore) release(now time.Time, key string, token Token) error {
	e := s.live(key, now)
	if e == nil || e.token != token || e.done {
		return staleErr(key)
	}
	s.remove(e)
	return nil
}

func (s *MemoryStore) extend(now time.Time, key string, token Token, lease time.Duration) error {
	e := s.live(key, now)
	if e == nil || e.token != token || e.done {
		return staleErr(key)
	}
	e.expires = now.Add(lease)
	heap.Fix(&s.inProgress, e.index)
	return nil
}

// Len returns the number of records held, expired ones included until they
// are swept.
func (s *MemoryStore) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.entries)
}

// Evictions returns how many completed records were dropped before their
// retention ran out because the store was full.
func (s *MemoryStore) Evictions() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.evictions
}

// live returns key's record, dropping it first if it has expired.
func (s *MemoryStore) live(key string, now time.Time) *memEntry {
	e := s.entries[key]
	if e != nil && !now.Before(e.expires) {
		s.remove(e)
		return nil
	}
	return e
}

func (s *MemoryStore) remove(e *memEntry) {
	delete(s.entries, e.key)
	if e.done {
		heap.Remove(&s.completed, e.index)
	} else {
		heap.Remove(&s.inProgress, e.index)
	}
}

// makeRoom drops expired records, or else the completed record nearest its
// expiry, and reports whether there is room for one more.
func (s *MemoryStore) makeRoom(now time.Time) bool {
	for _, h := range []*expiryHeap{&s.inProgress, &s.completed} {
		for len(*h) > 0 && !now.Before((*h)[0].expires) {
			s.remove((*h)[0])
		}
	}
	if len(s.entries) < s.max {
		return true
	}
	if len(s.completed) == 0 {
		return false
	}
	s.remove(s.completed[0])
	s.evictions++
	return true
}

// expiryHeap orders records by expiry, earliest first.
type expiryHeap []*memEntry

func (h expiryHeap) Len() int           { return len(h) }
func (h expiryHeap) Less(i, j int) bool { return h[i].expires.Before(h[j].expires) }
func (h expiryHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index = i
	h[j].index = j
}
func (h *expiryHeap) Push(x any) {
	e := x.(*memEntry)
	e.index = len(*h)
	*h = append(*h, e)
}
func (h *expiryHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return e
}

func checkDuration(name string, d time.Duration) error {
	if d <= 0 {
		return fmt.Errorf("idempotency: %s %v: must be positive", name, d)
	}
	return nil
}

func staleErr(key string) error { return fmt.Errorf("%w (key %q)", ErrStaleToken, key) }
