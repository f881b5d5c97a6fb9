package soaktest

import (
	"context"
	"time"

	"github.com/custody-go/custody/adapters/memory"
)

// AwaitEmpty waits until the memory broker's queue holds nothing, visible or
// in flight, or patience has passed, and reports a violation to l if it
// never emptied. A round's last consumer runs until then.
func (l *Log) AwaitEmpty(br *memory.Broker, queue string, patience time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := br.WaitEmpty(ctx, queue); err != nil {
		st, _ := br.Stats(queue)
		l.Violate("the queue never emptied: %v (%+v)", err, st)
	}
}
