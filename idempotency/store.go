package idempotency

import (
	"context"
	"crypto/rand"
	"errors"
	"time"
)

// Store records which idempotency keys are being processed and which are
// done. Implementations must be safe for concurrent use by many goroutines
// and, for shared stores, by many processes.
//
// A key moves through these states:
//
//	absent ──Claim──▶ in progress (token T, expires after lease)
//	in progress ──Complete(T)──▶ completed (expires after retention)
//	in progress ──Release(T)──▶ absent
//	in progress ──Extend(T)──▶ in progress (expiry moved to now + lease)
//	in progress, expired ──Claim──▶ in progress (new token: taken over)
//	completed, expired ──Claim──▶ in progress (the record was forgotten)
//
// A token is valid while the claim it came from is in progress and its lease
// has not run out. Complete, Release and Extend with a token that is not
// valid change nothing and return an error wrapping [ErrStaleToken]; the one
// exception is Complete repeated with the token that completed the key, which
// returns nil so that a retried Complete is harmless.
type Store interface {
	// Claim tries to take key for processing for the length of lease.
	//
	// It returns Acquired and a fresh token when the key was absent, or
	// held by a claim whose lease ran out, or completed longer than its
	// retention ago. It returns InProgressElsewhere when another claim
	// holds the key now, and Completed when the key was completed within
	// its retention; the token is empty in both cases.
	//
	// fingerprint summarises the payload (see [FingerprintBody]); empty
	// means "do not compare". When both the live record and the call carry
	// a fingerprint and they differ, Claim returns an error wrapping
	// [ErrFingerprintMismatch] instead of a state. A store that cannot hold
	// key or fingerprint returns an error wrapping [ErrUnstorableKey].
	Claim(ctx context.Context, key, fingerprint string, lease time.Duration) (State, Token, error)

	// Complete marks the claimed key done and keeps the record for
	// retention, so that later deliveries of the key are skipped.
	Complete(ctx context.Context, key string, token Token, retention time.Duration) error

	// Release gives the claimed key up so that a retry can claim it at once.
	Release(ctx context.Context, key string, token Token) error

	// Extend moves the expiry of the claim to lease from now, to keep a
	// long-running claim from being taken over.
	Extend(ctx context.Context, key string, token Token, lease time.Duration) error
}

// State is the outcome of a Claim.
type State int

const (
	// Acquired: the caller holds the key and should perform the effect.
	Acquired State = iota + 1
	// InProgressElsewhere: another claim holds the key; performing the
	// effect now would run it twice at once (an overlapping duplicate).
	InProgressElsewhere
	// Completed: the effect already happened (a sequential duplicate).
	Completed
)

func (s State) String() string {
	switch s {
	case Acquired:
		return "acquired"
	case InProgressElsewhere:
		return "in progress elsewhere"
	case Completed:
		return "completed"
	}
	return "invalid state"
}

// Token identifies one claim of a key. Stores compare it before completing,
// releasing or extending, so that a holder whose claim was taken over cannot
// disturb the new holder.
type Token string

// NewToken returns a random token, for Store implementations.
func NewToken() Token { return Token(rand.Text()) }

// Errors stores and the middleware return. Test for them with errors.Is.
var (
	// ErrStaleToken: the claim the token came from is no longer held (its
	// lease ran out and another consumer may have taken the key over, or it
	// was released or completed). Nothing was changed. An effect performed
	// under it may be performed again by the new holder.
	ErrStaleToken = errors.New("idempotency: the claim token is stale (the claim expired, was taken over, released or completed); nothing was changed")

	// ErrFingerprintMismatch: the key is already recorded for a different
	// payload. Two different messages share one idempotency key; fix the
	// producer or the KeyFunc. The middleware makes it a permanent error.
	ErrFingerprintMismatch = errors.New("idempotency: the key was already used for a different payload (fingerprint mismatch); check the producer's keys or the KeyFunc")

	// ErrNoKey: the KeyFunc returned an empty key (by default: the broker
	// gave the message no stable identity). The middleware makes it a
	// permanent error.
	ErrNoKey = errors.New("idempotency: the message has no idempotency key; the broker gave it no stable ID, so set a KeyFunc that reads one from the payload or headers")

	// ErrUnstorableKey: the store cannot hold the key or the fingerprint as
	// given (PostgreSQL text refuses invalid UTF-8 and NUL bytes, and its
	// index refuses entries near a third of a page). Retrying cannot help:
	// the middleware and pgtx make it a permanent error.
	ErrUnstorableKey = errors.New("idempotency: the store cannot hold this key or fingerprint; derive one it can (a hex hash of a binary value, say) in the KeyFunc or fingerprint function")

	// ErrInProgressElsewhere: the middleware found the key claimed by
	// another delivery that is still running (an overlapping duplicate). It
	// returns it wrapped in consumer.Defer, so the message is tried again
	// when the other delivery has completed (the retry is then skipped) or
	// failed (the retry runs the handler).
	ErrInProgressElsewhere = errors.New("idempotency: the key is being processed by another delivery (an overlapping duplicate); retrying later")

	// ErrClaimLost is the cause given to the handler's context when the
	// middleware could not keep the claim alive: another consumer may take
	// the key over, so the handler should stop its effect. Handle also
	// fails with it, without running the handler, when the store's reply
	// to the Claim came only after the claim's lease had run out.
	ErrClaimLost = errors.New("idempotency: the claim on the key was lost while the handler ran; another consumer may take it over")
)
