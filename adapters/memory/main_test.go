package memory

import (
	"testing"

	"go.uber.org/goleak"
)

// No goroutine a Source, a consumer running on it or a test started may
// outlive the tests: a Receive still waiting on a closed source shows here.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
