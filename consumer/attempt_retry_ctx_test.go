package consumer_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// A retry in place runs with a fresh context: the first attempt's, and a
// context derived from it, were cancelled (context.Canceled) when that
// attempt ended, whether or not the handler had looked at it; the second
// attempt's is live, and the delivery's loss reaches it rather than the
// first attempt's.
func TestRetryInPlaceGetsAFreshContext(t *testing.T) {
	for _, built := range []bool{false, true} {
		_, src := newRecallEnv(t, true, "a1") // FIFO: retries wait in place
		type seen struct {
			first, derived context.Context
			cancel         context.CancelFunc
		}
		var s seen
		second := make(chan error, 1)
		h := func(ctx context.Context, m *consumer.Message) error {
			if m.Attempt == 1 {
				s.first = ctx
				if built {
					s.derived, s.cancel = context.WithCancel(ctx)
				}
				return errors.New("again")
			}
			var err error
			switch {
			case ctx == s.first:
				err = errors.New("the retry ran with the first attempt's context")
			case s.first.Err() == nil || context.Cause(s.first) != context.Canceled:
				err = errors.New("the first attempt's context was not cancelled by its end")
			case s.derived != nil && s.derived.Err() == nil:
				err = errors.New("a context derived from the first attempt's outlived it")
			case ctx.Err() != nil:
				err = errors.New("the retry's context is done at its start")
			}
			if err == nil {
				var d *adapters.Delivery
				src.mu.Lock()
				d = src.first["a1"]
				src.mu.Unlock()
				d.Signal.Lose(adapters.ErrLeaseLost)
				select {
				case <-ctx.Done():
				case <-time.After(patience):
					err = errors.New("the loss did not cancel the retry's context")
				}
				if err == nil && !errors.Is(context.Cause(ctx), adapters.ErrLeaseLost) {
					err = errors.New("the retry's cause is not the loss")
				}
			}
			second <- err
			return nil
		}
		r := runOn(t, src, h, consumer.WithConcurrency(1),
			consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(time.Millisecond)}))
		if err := await(t, "the second attempt", second); err != nil {
			t.Errorf("built=%v: %v", built, err)
		}
		r.stop()
		if s.cancel != nil {
			s.cancel()
		}
	}
}
