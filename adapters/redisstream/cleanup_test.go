package redisstream

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func (e *env) consumers() map[string]int64 {
	e.t.Helper()
	cs, err := e.client.XInfoConsumers(e.ctx(), e.stream, e.group).Result()
	if err != nil {
		e.t.Fatal(err)
	}
	out := map[string]int64{}
	for _, c := range cs {
		out[c.Name] = c.Pending
	}
	return out
}

// TestCloseDeletesItsNameOnlyWhenItHoldsNothing: a Source that acked what it
// read leaves no name behind; one that still holds an entry keeps its name,
// and the entry stays pending (XGROUP DELCONSUMER would have dropped it from
// the group for good).
func TestCloseDeletesItsNameOnlyWhenItHoldsNothing(t *testing.T) {
	e := newEnv(t)
	e.publish("a", "b")
	done := e.open(WithConsumerCleanup(0))
	ds := receiveN(t, done, 1)
	if err := done.Ack(e.ctx(), ds); err != nil {
		t.Fatal(err)
	}
	holding := e.open(WithConsumerCleanup(0))
	receiveN(t, holding, 1)
	done.Close()
	holding.Close()
	cs := e.consumers()
	if _, ok := cs[done.Consumer()]; ok {
		t.Errorf("the consumer that held nothing is still in the group: %v", cs)
	}
	if cs[holding.Consumer()] != 1 {
		t.Errorf("the consumer holding an entry was deleted, or lost it: %v", cs)
	}
	if p := e.pending(); len(p) != 1 {
		t.Errorf("pending %+v, want the held entry", p)
	}
}

// TestCleanupDeletesIdleNamesThatHoldNothing leaves two consumer names of
// processes gone, one holding an entry: New deletes the idle one that holds
// nothing, and keeps the other with its entry.
func TestCleanupDeletesIdleNamesThatHoldNothing(t *testing.T) {
	e := newEnv(t)
	e.publish("a", "b")
	if err := e.client.XGroupCreate(e.ctx(), e.stream, e.group, "0").Err(); err != nil {
		t.Fatal(err)
	}
	read := func(name string) string {
		res, err := e.client.XReadGroup(e.ctx(), &redis.XReadGroupArgs{Group: e.group, Consumer: name, Streams: []string{e.stream, ">"}, Count: 1, Block: -1}).Result()
		if err != nil {
			t.Fatal(err)
		}
		return res[0].Messages[0].ID
	}
	id := read("gone-empty")
	e.client.XAck(e.ctx(), e.stream, e.group, id)
	read("gone-holding")
	time.Sleep(60 * time.Millisecond)
	src := e.open(WithConsumerCleanup(50 * time.Millisecond))
	defer src.Close()
	cs := e.consumers()
	if _, ok := cs["gone-empty"]; ok {
		t.Errorf("the idle consumer holding nothing was kept: %v", cs)
	}
	if cs["gone-holding"] != 1 {
		t.Errorf("the idle consumer holding an entry was deleted: %v", cs)
	}
}
