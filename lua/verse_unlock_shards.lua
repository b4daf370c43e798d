-- verse_unlock_shards.lua: release Verse shard locks the caller holds, optionally leave.
--
-- KEYS[1]  liveness   string "{VERSE:STREAM:SHARDLOCK}:SERVICE_LIVENESS:<caller>"
-- KEYS[2]  members    sorted set of the group's live eventbus consumers
-- KEYS[3..] locks     the lock keys of the shards to release
-- ARGV[1]  caller's consumer ID
-- ARGV[2]  "1" to also leave (graceful shutdown: drop out of the members, delete the liveness
--          key, so that Verse's consumers may take any lock it still holds at once), else "0"
-- ARGV[3..] the shards to release, one per lock key
--
-- A lock held by another consumer (eventbus's or Verse's) is left alone; tokens are kept.
-- Returns the list of shards released.

local liveness = KEYS[1]
local members = KEYS[2]
local me = ARGV[1]
local leave = ARGV[2] == '1'

local released = {}
for i = 3, #ARGV do
  if redis.pcall('GET', KEYS[i]) == me then  -- (a key of another type: not ours)
    redis.call('DEL', KEYS[i])
    released[#released + 1] = tonumber(ARGV[i])
  end
end
if leave then
  redis.call('ZREM', members, me)
  redis.call('DEL', liveness)
end
return released
