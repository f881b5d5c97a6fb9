package redisstream

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/custody-go/custody/internal/testkit/testparallel"
)

// TestMain runs the tests, or, in a child process a test started, the
// consumer that test kills (see kill_test.go). No goroutine a Source, a
// consumer running on it or a test started may outlive the tests.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	testparallel.AtLeast(8) // the conformance checks wait on leases and quiet periods
	goleak.VerifyTestMain(m)
}
