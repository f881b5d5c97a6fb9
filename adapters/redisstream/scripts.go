package redisstream

import "github.com/redis/go-redis/v9"

// The Lua scripts the Source runs. Each one is a single round trip and runs
// atomically on the server, which is what makes "check the owner, then
// claim" safe: between the two no other consumer can claim the entry.
//
// Every script reads the server's clock (TIME) where it needs one, so that
// due times and idle times are measured by one clock whatever the
// consumers' clocks say.

// flag is a script's yes-or-no argument: "1" or "0".
func flag(b bool) string {
	if b {
		return "1"
	}
	return "0"
}

// goneLua defines gone(stream, id), what the renewal and give-back scripts
// report for an entry no longer pending: 2 when it is no longer in the
// stream either, 0 when it is. Redis drops a pending entry deleted from the
// stream (trimmed, XDEL) from the pending list at the first XCLAIM or
// XAUTOCLAIM that meets it, whoever holds it and however briefly idle (any
// consumer's reclaim scan): the holder then finds it not pending, and only
// the stream tells it that the entry was deleted (no one else can ever be
// handed it; its handler runs on), not acked elsewhere after a reclaim.
const goneLua = `
local function gone(stream, id)
  if #redis.call('XRANGE', stream, id, id) == 0 then return 2 end
  return 0
end
`

// extendScript renews entries this consumer owns by resetting their idle
// time, and reports, per entry, 1 when renewed, 0 when the entry is no
// longer pending in the group (acked by another consumer after a reclaim,
// or the group was recreated), 2 when the entry was deleted from the stream
// while this consumer held it (XCLAIM then drops it from the pending list,
// as does any consumer's XAUTOCLAIM: no one else can ever be handed it;
// see goneLua), 3 when this consumer claimed the entry again since (its
// delivery count is no longer the one given), or the name of the consumer
// that claimed it. A plain XCLAIM would take the entry back from that
// consumer.
//
// The delivery count is the fence: every claim that hands an entry out
// counts it up, and a renewal or give-back names the count its delivery was
// handed out with. The owner alone is not enough, since a Source claims its
// own entries again (those it gave back, and those whose lease it lost): a
// call for the earlier delivery reaching Redis late, or sent again after
// its answer was lost, would otherwise renew or give back the later one.
//
//	KEYS[1] stream
//	ARGV[1] group, ARGV[2] consumer, ARGV[3] idle time to set (ms),
//	ARGV[4..] pairs: id, delivery count
var extendScript = redis.NewScript(goneLua + `
local stream, group, me, idle = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local res = {}
for i = 4, #ARGV, 2 do
  local id, count = ARGV[i], tonumber(ARGV[i + 1])
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  if #p == 0 then
    res[#res + 1] = gone(stream, id)
  elseif p[1][2] ~= me then
    res[#res + 1] = p[1][2]
  elseif p[1][4] ~= count then
    res[#res + 1] = 3
  else
    local c = redis.call('XCLAIM', stream, group, me, 0, id, 'IDLE', idle, 'JUSTID')
    if #c == 0 then res[#res + 1] = 2 else res[#res + 1] = 1 end
  end
end
return res
`)

// nackScript gives entries this consumer owns back to the group, claimable
// after a delay: it sets the idle time to lease - delay, or, for a delay
// longer than the lease, resets it and parks the entry's due time in the
// sorted set (see Retries in the package documentation, and reclaimScript).
// JUSTID keeps the delivery count as it is; with ARGV[4] = 1 ("undeliver")
// the count is lowered by one, for entries read but never handed to the
// runtime. Each entry names the delivery count it was handed out with, the
// fence of extendScript; results per entry as for extendScript.
//
//	KEYS[1] stream, KEYS[2] sorted set of parked entries
//	ARGV[1] group, ARGV[2] consumer, ARGV[3] lease (ms), ARGV[4] undeliver (0 or 1),
//	ARGV[5..] triples: id, delivery count, delay (ms)
var nackScript = redis.NewScript(goneLua + `
local stream, delays = KEYS[1], KEYS[2]
local group, me, lease, undeliver = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4] == '1'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local res = {}
local longest = 0
for i = 5, #ARGV, 3 do
  local id, count, delay = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  if #p == 0 then
    res[#res + 1] = gone(stream, id)
  elseif p[1][2] ~= me then
    res[#res + 1] = p[1][2]
  elseif p[1][4] ~= count then
    res[#res + 1] = 3
  else
    local idle = lease - delay
    if delay > lease then
      idle = 0
      redis.call('ZADD', delays, now + delay, id)
      if delay > longest then longest = delay end
    else
      redis.call('ZREM', delays, id)
      if idle > lease then idle = lease end
    end
    local args = {'XCLAIM', stream, group, me, 0, id, 'IDLE', idle}
    if undeliver then
      local count = p[1][4] - 1
      if count < 0 then count = 0 end
      args[#args + 1] = 'RETRYCOUNT'
      args[#args + 1] = count
    end
    args[#args + 1] = 'JUSTID'
    local c = redis.call(unpack(args))
    if #c == 0 then res[#res + 1] = 2 else res[#res + 1] = 1 end
  end
end
if longest > 0 then
  -- The set outlives its latest due time by two leases, then goes: a
  -- stream abandoned with parked entries leaves nothing behind for good.
  local keep = longest + 2 * lease
  if redis.call('PTTL', delays) < keep then redis.call('PEXPIRE', delays, keep) end
end
return res
`)

// reclaimScript claims entries whose idle time reached the lease (their
// consumer died, or a retry delay has passed) and returns them with their
// delivery counts (which the claim has counted up). First the ids in
// ARGV[7..], entries this consumer gave back and expects due, then, when
// ARGV[6] is 1, a scan of the pending list with XAUTOCLAIM from the cursor
// in ARGV[4], until ARGV[5] entries are claimed, the scan wraps around, or
// ten XAUTOCLAIM calls were made.
//
// An entry whose due time in the sorted set of parked entries is still
// ahead is not returned: it is parked again (idle time set so that it falls
// due at its due time, or reset when that is more than a lease away) with
// the delivery count it had. Entries deleted from the stream while pending
// are dropped from the pending list by XAUTOCLAIM and XCLAIM themselves
// (Redis 7.0) and returned apart, never as entries.
//
// It returns {cursor, entries, deleted ids, later, parked}: entries as
// {id, delivery count, {field, value, ...}}; later as pairs {id, ms until
// due} for the given ids this consumer still owns and that are not due yet
// (the clocks of client and server differ); parked the number parked again.
//
//	KEYS[1] stream, KEYS[2] sorted set of parked entries
//	ARGV[1] group, ARGV[2] consumer, ARGV[3] lease (ms), ARGV[4] cursor,
//	ARGV[5] entries wanted, ARGV[6] scan (0 or 1), ARGV[7..] ids
var reclaimScript = redis.NewScript(`
local stream, delays = KEYS[1], KEYS[2]
local group, me, lease = ARGV[1], ARGV[2], tonumber(ARGV[3])
local cursor, want, scan = ARGV[4], tonumber(ARGV[5]), ARGV[6] == '1'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', delays, '-inf', now)
local out, deleted, later = {}, {}, {}
local parked = 0
local function take(id, fields)
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  local count = p[1][4]
  local due = redis.call('ZSCORE', delays, id)
  if due then
    local left = tonumber(due) - now
    local idle = 0
    if left < lease then idle = lease - left end
    local back = count - 1
    if back < 0 then back = 0 end
    redis.call('XCLAIM', stream, group, me, 0, id, 'IDLE', idle, 'RETRYCOUNT', back, 'JUSTID')
    parked = parked + 1
  else
    out[#out + 1] = {id, count, fields}
  end
end
for i = 7, #ARGV do
  local id = ARGV[i]
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  if #p > 0 then
    if p[1][3] >= lease then
      local c = redis.call('XCLAIM', stream, group, me, lease, id)
      if #c == 0 then
        deleted[#deleted + 1] = id
      else
        take(id, c[1][2])
      end
    elseif p[1][2] == me then
      later[#later + 1] = id
      later[#later + 1] = lease - p[1][3]
    end
  end
end
if scan then
  local calls = 0
  while #out < want and calls < 10 do
    calls = calls + 1
    local r = redis.call('XAUTOCLAIM', stream, group, me, lease, cursor, 'COUNT', want - #out)
    cursor = r[1]
    for _, e in ipairs(r[2]) do take(e[1], e[2]) end
    for _, id in ipairs(r[3]) do deleted[#deleted + 1] = id end
    if cursor == '0-0' then break end
  end
end
for _, id in ipairs(deleted) do redis.call('ZREM', delays, id) end
return {cursor, out, deleted, later, parked}
`)

// cleanupScript deletes consumers of the group that hold no pending entry:
// this one (ARGV[2]) and, when ARGV[3] > 0, any other idle for at least
// ARGV[3] ms. The check and the deletion are one atomic step, so no entry
// can be assigned to a consumer between the two (see Consumer names in the
// package documentation). It returns the names deleted.
//
//	KEYS[1] stream
//	ARGV[1] group, ARGV[2] consumer, ARGV[3] idle threshold (ms; 0: only this consumer)
var cleanupScript = redis.NewScript(`
local stream, group, me, limit = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local gone = {}
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', stream, group)) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['pending'] == 0 and (f['name'] == me or (limit > 0 and f['idle'] >= limit)) then
    redis.call('XGROUP', 'DELCONSUMER', stream, group, f['name'])
    gone[#gone + 1] = f['name']
  end
end
return gone
`)
