package rabbitmq

import (
	"testing"

	"go.uber.org/goleak"
)

// Every goroutine the adapter starts (supervisor, pumps, in-place retries)
// must end by the time its Source is closed.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
