package jetstream

import (
	"testing"

	"go.uber.org/goleak"
)

// No goroutine a Source, a consumer running on it or a test started may
// outlive the tests (connections are closed by each test's cleanup).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
