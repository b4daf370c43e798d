-- A re-implementation, for tests, of Verse's unlock_shards.lua (verse-redis Subscriber::Stream).
--
-- KEYS[1]  "VERSE:STREAM:SHARDLOCK" (declared, unused)
-- ARGV[1]  group, ARGV[2] service ID, ARGV[3] shard count, ARGV[4..] channel, flags, ...
--
-- Deletes the lock of each shard whose bit is set in the channel's flags, if the caller holds
-- it. Returns "1".

local group_name = ARGV[1]
local service_id = ARGV[2]
local shard_count = tonumber(ARGV[3])

for s = 4, #ARGV, 2 do
  local channel = ARGV[s]
  local flags = tonumber(ARGV[s + 1])
  for i = 0, shard_count - 1 do
    if math.floor(flags / 2 ^ i) % 2 == 1 then
      local key = '{VERSE:STREAM:SHARDLOCK}:' .. channel .. ':' .. i .. ':' .. group_name
      if redis.call('GET', key) == service_id then
        redis.call('DEL', key)
      end
    end
  end
end
return '1'
