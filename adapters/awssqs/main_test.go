package awssqs

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/custody-go/custody/internal/testkit/sqsemu"
	"github.com/custody-go/custody/internal/testkit/testparallel"
)

func TestMain(m *testing.M) {
	testparallel.AtLeast(8) // the conformance checks wait on visibility timeouts
	code := m.Run()
	if code == 0 {
		// Every Source and consumer a test started must have stopped its
		// goroutines. Idle HTTP keep-alive connections belong to the
		// transport, and the emulator's watchers to package sqsemu.
		if err := goleak.Find(
			goleak.IgnoreAnyFunction("github.com/custody-go/custody/internal/testkit/sqsemu.Launch.func1"),
			goleak.IgnoreAnyFunction("github.com/custody-go/custody/internal/testkit/sqsemu.Launch.func2"),
			goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
			goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
			goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
		); err != nil {
			os.Stderr.WriteString("goroutine leak: " + err.Error() + "\n")
			code = 1
		}
	}
	// After the leak check: stopping the emulator would end any call still
	// in flight and hide the goroutine that made it.
	sqsemu.Stop()
	os.Exit(code)
}
