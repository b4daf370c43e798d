-- heartbeat.lua: refresh the caller's liveness in its group.
--
-- KEYS[1]  members  sorted set: consumer ID -> liveness deadline (server time, ms)
-- ARGV[1]  consumer ID of the caller
-- ARGV[2]  liveness TTL (ms)
--
-- Returns 1 if the caller was still live before this refresh, 0 if its liveness had already
-- expired (its locks may belong to others now: it must re-lock before going on).

local members = KEYS[1]
local me = ARGV[1]
local ttl_ms = tonumber(ARGV[2])

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local deadline = redis.call('ZSCORE', members, me)
local was_live = 0
if deadline and tonumber(deadline) >= now_ms then was_live = 1 end
redis.call('ZADD', members, now_ms + ttl_ms, me)
return was_live
