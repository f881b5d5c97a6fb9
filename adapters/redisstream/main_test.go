package redisstream

import (
	"testing"

	"go.uber.org/goleak"
)

// No goroutine a Source, a consumer running on it or a test started may
// outlive the tests. go-redis keeps none of its own per client once the
// client is closed.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
