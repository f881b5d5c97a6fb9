package idempotency

import (
	"context"
	"fmt"
	"time"
)

// BatchStore is a Store that also takes the keys of a whole batch in one
// call: one round trip (a Redis pipeline, one PostgreSQL statement) instead
// of one per key. The batch middleware ([NewBatch]) uses these methods when
// its store has them, and the Store methods one key at a time when it has
// not. The stores of this module (MemoryStore, redisstore, pgstore) are
// BatchStores.
//
// Each method does for every entry what the Store method of the same name
// does for one key, with the same states, tokens and errors, and returns
// one result per entry, in the entries' order. The entries of one call
// name distinct keys. A failure of the whole call (the store unreachable)
// is reported as every entry's error; a failure of some entries (a stale
// token, a fingerprint mismatch, a key the store cannot hold) as theirs
// alone. As with one key, an entry whose outcome is unknown (the reply was
// lost) may have taken effect: a claim made that way runs out after its
// lease.
type BatchStore interface {
	Store

	// ClaimBatch claims each key as Claim does.
	ClaimBatch(ctx context.Context, claims []ClaimRequest, lease time.Duration) []ClaimResult

	// CompleteBatch completes each claim as Complete does.
	CompleteBatch(ctx context.Context, held []HeldClaim, retention time.Duration) []error

	// ReleaseBatch releases each claim as Release does.
	ReleaseBatch(ctx context.Context, held []HeldClaim) []error

	// ExtendBatch extends each claim as Extend does.
	ExtendBatch(ctx context.Context, held []HeldClaim, lease time.Duration) []error
}

// ClaimRequest is one key to claim, with its payload's fingerprint (empty:
// do not compare), as the arguments of Store.Claim.
type ClaimRequest struct {
	Key         string
	Fingerprint string
}

// ClaimResult is the outcome of one key's claim, as the results of
// Store.Claim.
type ClaimResult struct {
	State State
	Token Token
	Err   error
}

// HeldClaim is a claim made: its key and the token it was given.
type HeldClaim struct {
	Key   string
	Token Token
}

// checked returns res if the store's method returned one result for each
// of n entries; otherwise (a bug in the store) n results made by fail from
// an error saying so, so that no entry is taken for a success.
func checked[R any](res []R, n int, method string, fail func(error) R) []R {
	if len(res) == n {
		return res
	}
	err := fmt.Errorf("the store's %s returned %d results for %d entries (a bug in the BatchStore implementation)", method, len(res), n)
	res = make([]R, n)
	for i := range res {
		res[i] = fail(err)
	}
	return res
}
