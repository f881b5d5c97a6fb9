package jetstream

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/custody-go/custody/internal/testkit/testparallel"
)

// No goroutine a Source, a consumer running on it or a test started may
// outlive the tests (connections are closed by each test's cleanup).
func TestMain(m *testing.M) {
	testparallel.AtLeast(8) // the conformance checks wait on leases and quiet periods
	goleak.VerifyTestMain(m)
}
