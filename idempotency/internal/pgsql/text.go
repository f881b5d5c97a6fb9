package pgsql

import (
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/custody-go/custody/idempotency"
)

// MaxKeyBytes bounds keys: a btree index entry must fit in a third of an
// 8 kB page (2,704 bytes, less the entry's header), or the insert fails.
const MaxKeyBytes = 2600

// CheckText reports, wrapping idempotency.ErrUnstorableKey, why key or
// fingerprint cannot be stored in a text column: PostgreSQL rejects invalid
// UTF-8 and NUL bytes on every attempt, so the message must not be retried.
func CheckText(key, fingerprint string) error {
	if len(key) > MaxKeyBytes {
		return fmt.Errorf("%w: the key is %d bytes, more than the %d an index entry holds", idempotency.ErrUnstorableKey, len(key), MaxKeyBytes)
	}
	for _, f := range [...]struct{ what, v string }{{"key", key}, {"fingerprint", fingerprint}} {
		if !utf8.ValidString(f.v) {
			return fmt.Errorf("%w: the %s %q is not valid UTF-8", idempotency.ErrUnstorableKey, f.what, f.v)
		}
		if strings.IndexByte(f.v, 0) >= 0 {
			return fmt.Errorf("%w: the %s %q holds a NUL byte", idempotency.ErrUnstorableKey, f.what, f.v)
		}
	}
	return nil
}
