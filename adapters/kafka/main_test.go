package kafka

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/custody-go/custody/internal/testkit/testparallel"
)

// Every goroutine the Source, its client, the dead-letter sink and the test
// clusters start must be gone when the tests end.
func TestMain(m *testing.M) {
	testparallel.AtLeast(8) // the conformance checks wait on leases and quiet periods
	goleak.VerifyTestMain(m)
}
