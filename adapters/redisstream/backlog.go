package redisstream

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/adapters"
)

var _ adapters.BacklogReporter = (*Source)(nil)

// Backlog asks the server for the group's backlog (adapters.BacklogReporter),
// which the runtime polls (see consumer.WithBacklogInterval):
//
//   - Waiting is the group's lag: entries of the stream not yet delivered to
//     any of its consumers; -1 when Redis cannot tell (entries were deleted
//     in that range).
//   - InFlight is the group's pending count: entries delivered and not yet
//     acked, held by a consumer or waiting in the pending list to be
//     reclaimed (a retry's delay, a dead consumer's entries).
//   - OldestAge is the age of the oldest entry not yet delivered (the first
//     after the group's last delivered id), from the milliseconds of its id
//     to the server's clock; zero when nothing waits, or when its id was
//     chosen by the producer rather than made by XADD from the time.
//
// It is one script call (XINFO GROUPS, XRANGE of one entry, TIME), counted
// as an xinfo command; the entry stays on the server.
func (s *Source) Backlog(ctx context.Context) (adapters.Backlog, error) {
	if s.isClosed() {
		return adapters.Backlog{}, adapters.ErrClosed
	}
	s.count(cmdInfo)
	sent := time.Now()
	res, err := backlogScript.Run(ctx, s.client, []string{s.stream}, s.group).Slice()
	s.conn.observe(sent, err)
	if err != nil {
		s.failed(cmdInfo)
		if isNoGroup(err) || isNoSuchKey(err) {
			return adapters.Backlog{}, fmt.Errorf("%w: stream %q, group %q", ErrGroupMissing, s.stream, s.group)
		}
		return adapters.Backlog{}, fmt.Errorf("redisstream: reading the backlog of group %q of stream %q: %w", s.group, s.stream, err)
	}
	return parseBacklog(res)
}

// parseBacklog reads backlogScript's answer.
func parseBacklog(res []any) (adapters.Backlog, error) {
	bad := func() (adapters.Backlog, error) {
		return adapters.Backlog{}, fmt.Errorf("redisstream: unexpected answer from the backlog script: %v", res)
	}
	if len(res) != 5 {
		return bad()
	}
	pending, ok1 := res[0].(int64)
	lag, ok2 := res[1].(int64)
	oldest, ok3 := res[2].(string)
	sec, err1 := toInt(res[3])
	usec, err2 := toInt(res[4])
	if !ok1 || !ok2 || !ok3 || err1 != nil || err2 != nil {
		return bad()
	}
	b := adapters.Backlog{Waiting: lag, InFlight: pending}
	if at := idTime(oldest); !at.IsZero() {
		now := time.Unix(sec, usec*1000)
		b.OldestAge = max(now.Sub(at), 0)
	}
	return b, nil
}

func toInt(v any) (int64, error) {
	switch v := v.(type) {
	case int64:
		return v, nil
	case string:
		return strconv.ParseInt(v, 10, 64)
	}
	return 0, errors.New("not a number")
}

// backlogScript returns the group's pending count, its lag (-1 when Redis
// cannot tell), the id of the oldest entry not yet delivered to it ("" when
// none), and the server's time (seconds, microseconds). It writes nothing,
// and says so, so that it runs on a server out of memory too.
//
//	KEYS[1] stream
//	ARGV[1] group
var backlogScript = redis.NewScript(`#!lua flags=no-writes
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
for _, g in ipairs(groups) do
  local f = {}
  for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
  if f['name'] == ARGV[1] then
    local lag = f['lag']
    if not lag then lag = -1 end
    local oldest = ''
    if lag ~= 0 then
      local r = redis.call('XRANGE', KEYS[1], '(' .. f['last-delivered-id'], '+', 'COUNT', 1)
      if #r > 0 then oldest = r[1][1] end
    end
    local t = redis.call('TIME')
    return {f['pending'], lag, oldest, t[1], t[2]}
  end
end
return redis.error_reply('NOGROUP no such consumer group for this stream')
`)
