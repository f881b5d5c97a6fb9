package crashbench

import (
	"flag"
	"os"
	"testing"
	"time"

	"github.com/custody-go/custody/internal/testkit/sqsemu"
)

var (
	flagKills    = flag.Int("crash.kills", 5, "SIGKILLs per crash benchmark run")
	flagLife     = flag.Duration("crash.life", 2*time.Second, "each kill falls at a moment uniform in this long after the child's first effect")
	flagMessages = flag.Int("crash.messages", 3000, "messages published at the start of each run; a crash run tops the stream up until its last kill")
)

// The work a child does per message, and how many messages it handles at
// once: the setting of the measurements in issue 18.
const (
	work        = 2 * time.Millisecond
	concurrency = 8
)

func TestMain(m *testing.M) {
	// Started again by a test as a consumer: be that consumer and nothing
	// else.
	if role := os.Getenv(envRole); role != "" {
		os.Exit(runChild(role))
	}
	code := m.Run()
	sqsemu.Stop()
	os.Exit(code)
}
