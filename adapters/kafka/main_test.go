package kafka

import (
	"testing"

	"go.uber.org/goleak"
)

// Every goroutine the Source, its client, the dead-letter sink and the test
// clusters start must be gone when the tests end.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
