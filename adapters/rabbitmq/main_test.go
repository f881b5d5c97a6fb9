package rabbitmq

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/custody-go/custody/internal/testkit/testparallel"
)

// Every goroutine the adapter starts (supervisor, pumps, in-place retries)
// must end by the time its Source is closed.
func TestMain(m *testing.M) {
	testparallel.AtLeast(8) // the conformance checks wait on leases and quiet periods
	goleak.VerifyTestMain(m)
}
