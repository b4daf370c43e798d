-- heartbeat.lua: refresh the caller's liveness in its group, if it is still live.
--
-- KEYS[1]  members  sorted set: consumer ID -> liveness deadline (server time, ms)
-- ARGV[1]  consumer ID of the caller
-- ARGV[2]  liveness TTL (ms)
--
-- Returns 1 if the caller was still live (its deadline not passed): its deadline is moved to
-- now + TTL. Returns 0 if its liveness had expired (or it never joined): its locks may belong to
-- others now, and it is NOT made live again. Only lock_shards.lua revives a member, and its reply
-- says which locks the member still holds. A heartbeat that revived it could answer 0 on a
-- connection that is then lost, and the next one would answer 1: the caller would go on with
-- locks taken by others while it had lapsed.

local members = KEYS[1]
local me = ARGV[1]
local ttl_ms = tonumber(ARGV[2])

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local deadline = redis.call('ZSCORE', members, me)
if deadline and tonumber(deadline) >= now_ms then
  redis.call('ZADD', members, now_ms + ttl_ms, me)
  return 1
end
return 0
