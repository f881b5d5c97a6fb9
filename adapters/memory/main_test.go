package memory

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/custody-go/custody/internal/testkit/testparallel"
)

// No goroutine a Source, a consumer running on it or a test started may
// outlive the tests: a Receive still waiting on a closed source shows here.
func TestMain(m *testing.M) {
	testparallel.AtLeast(8) // the conformance checks wait on leases and quiet periods
	goleak.VerifyTestMain(m)
}
