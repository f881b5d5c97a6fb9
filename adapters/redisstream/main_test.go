package redisstream

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain runs the tests, or, in a child process a test started, the
// consumer that test kills (see kill_test.go). No goroutine a Source, a
// consumer running on it or a test started may outlive the tests.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	goleak.VerifyTestMain(m)
}
