-- confirm_lock.lua: refresh the caller's liveness only while it is still live and still holds one
-- shard's lock with a given fencing token. It never revives a member nor takes a lock.
--
-- KEYS[1]  members  sorted set: consumer ID -> liveness deadline (server time, ms)
-- KEYS[2]  locks    hash: "<shard>" -> owner consumer ID, "<shard>:token" -> fencing token
-- ARGV[1]  consumer ID of the caller
-- ARGV[2]  liveness TTL (ms)
-- ARGV[3]  shard
-- ARGV[4]  the caller's fencing token for that shard
--
-- A live consumer's catch-up of a shard confirms its lock with this, not with lock_shards.lua:
-- lock_shards revives a lapsed member, and its reply would reach the catch-up, not the
-- consumer's table of held shards; the consumer's next heartbeat would then find it live and
-- renew its lease over shards taken by others while it had lapsed (heartbeat.lua: only the lock
-- round whose reply the consumer applies may revive it).
-- Returns 1 (still live and holding: deadline moved to now + TTL) or 0 (lapsed, or the lock is
-- not the caller's with that token: nothing changed). Plain Lua 5.1, so fakeredis runs it too.

local members = KEYS[1]
local me = ARGV[1]
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local deadline = redis.call('ZSCORE', members, me)
if not deadline or tonumber(deadline) < now_ms then
  return 0
end
if redis.call('HGET', KEYS[2], ARGV[3]) ~= me
    or redis.call('HGET', KEYS[2], ARGV[3] .. ':token') ~= ARGV[4] then
  return 0
end
redis.call('ZADD', members, now_ms + tonumber(ARGV[2]), me)
return 1
