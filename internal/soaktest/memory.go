package soaktest

import (
	"time"

	"github.com/custody-go/custody/adapters/memory"
)

// AwaitEmpty waits until the memory broker's queue holds nothing, visible or
// in flight, or patience has passed, and reports a violation to l if it
// never emptied. A round's last consumer runs until then.
func (l *Log) AwaitEmpty(br *memory.Broker, queue string, patience time.Duration) {
	deadline := time.Now().Add(patience)
	for {
		st, err := br.Stats(queue)
		if err != nil {
			l.Violate("Stats(%q): %v", queue, err)
			return
		}
		if st.Visible == 0 && st.InFlight == 0 {
			return
		}
		if time.Now().After(deadline) {
			l.Violate("the queue never emptied: %+v", st)
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}
