package consumer

import (
	"context"
	"sync"
	"testing"
	"time"
)

// One release that frees room for several receivers wakes them all, not
// one: several receivers wait for room at once (an SQS source's pollers).
func TestCreditWakesEveryReceiverThereIsRoomFor(t *testing.T) {
	c := newCredit(40, 0, 10)
	for range 4 {
		if _, ok := c.acquire(context.Background()); !ok {
			t.Fatal("acquire failed")
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	got := make(chan int, 4)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if n, ok := c.acquire(ctx); ok {
				got <- n
			}
		}()
	}
	time.Sleep(20 * time.Millisecond) // all four wait
	c.release(40)
	wg.Wait()
	close(got)
	total := 0
	for n := range got {
		total += n
	}
	if total != 40 {
		t.Fatalf("the receivers took %d units after 40 were released, want 40: some were never woken", total)
	}
}
