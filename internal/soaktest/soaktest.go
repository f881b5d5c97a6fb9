// Package soaktest holds what the randomized soak tests share: how their
// rounds are seeded and replayed, and how a round waits for its queue to
// empty.
package soaktest

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
)

// Seeds returns the seeds of the rounds to run: rounds consecutive seeds
// starting from the clock, as many as the environment variable
// prefix+"_ROUNDS" says if set; or only the seed in prefix+"_SEED", to
// replay a round a log named.
func Seeds(prefix string, rounds int) []uint64 {
	if v, err := strconv.ParseUint(os.Getenv(prefix+"_SEED"), 10, 64); err == nil {
		return []uint64{v}
	}
	if v, err := strconv.Atoi(os.Getenv(prefix + "_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	first := uint64(time.Now().UnixNano())
	seeds := make([]uint64, rounds)
	for i := range seeds {
		seeds[i] = first + uint64(i)
	}
	return seeds
}

// AwaitEmpty waits until the broker's queue holds nothing, visible or in
// flight, or patience has passed. It returns the queue's last stats and
// whether it emptied.
func AwaitEmpty(br *memory.Broker, queue string, patience time.Duration) (memory.Stats, bool, error) {
	deadline := time.Now().Add(patience)
	for {
		st, err := br.Stats(queue)
		if err != nil {
			return st, false, err
		}
		if st.Visible == 0 && st.InFlight == 0 {
			return st, true, nil
		}
		if time.Now().After(deadline) {
			return st, false, nil
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Live runs c for life, then calls kill, if not nil, and ends Run's
// context; with life 0 it runs c until the broker's queue is empty. It
// returns what went wrong besides Run's error (a queue that never emptied,
// a Run that did not return within a minute of its stop), and Run's error.
func Live(c *consumer.Consumer, br *memory.Broker, queue string, life time.Duration, kill func()) (problems []string, runErr error) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	if life > 0 {
		time.Sleep(life)
		if kill != nil {
			kill()
		}
	} else {
		st, empty, err := AwaitEmpty(br, queue, 2*time.Minute)
		switch {
		case err != nil:
			problems = append(problems, err.Error())
		case !empty:
			problems = append(problems, fmt.Sprintf("the queue never emptied: %+v", st))
		}
	}
	cancel()
	select {
	case runErr = <-done:
	case <-time.After(time.Minute):
		problems = append(problems, "Run did not return within a minute of its stop")
	}
	return problems, runErr
}
