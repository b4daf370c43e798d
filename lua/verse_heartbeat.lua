-- verse_heartbeat.lua: refresh the caller's liveness (and its locks' TTL), if it is still live.
--
-- KEYS[1]  liveness   string "{VERSE:STREAM:SHARDLOCK}:SERVICE_LIVENESS:<caller>"
-- KEYS[2]  members    sorted set of the group's live eventbus consumers
-- KEYS[3..] locks     the lock keys of every shard of the channel
-- ARGV[1]  caller's consumer ID
-- ARGV[2]  liveness TTL (ms)
-- ARGV[3]  lock TTL (s)
--
-- Returns 1 if the caller was still live (its members deadline not passed and its liveness key
-- present): both are extended by the TTL, and its locks' keys get EX <lock TTL> again (Verse's
-- expire after 3200 s). Returns 0 otherwise, reviving nothing: its locks may be others' now,
-- and only verse_lock_shards.lua says which it still holds (as heartbeat.lua).

local liveness = KEYS[1]
local members = KEYS[2]
local me = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
local lock_ttl_s = tonumber(ARGV[3])

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local deadline = redis.call('ZSCORE', members, me)
if not deadline or tonumber(deadline) < now_ms or redis.call('EXISTS', liveness) == 0 then
  return 0
end
redis.call('ZADD', members, now_ms + ttl_ms, me)
redis.call('SET', liveness, '1', 'PX', ttl_ms)
for i = 3, #KEYS do
  if redis.pcall('GET', KEYS[i]) == me then  -- (a key of another type: not ours)
    redis.call('EXPIRE', KEYS[i], lock_ttl_s)
  end
end
return 1
