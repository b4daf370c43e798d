-- A re-implementation, for tests, of Verse's lock_shards.lua (verse-redis Subscriber::Stream):
-- the same ARGV, the same keys and the same reply, with the shard flags computed by arithmetic
-- (fakeredis has no Lua `bit` library), signed 32-bit as `bit.bor` returns them.
--
-- KEYS[1]  "VERSE:STREAM:SHARDLOCK" (declared, unused: it gives the script its slot)
-- ARGV[1]  group (Verse's service name), ARGV[2] service ID, ARGV[3] shard count,
-- ARGV[4..] channels
--
-- For each channel and shard i: the lock "{VERSE:STREAM:SHARDLOCK}:<channel>:<i>:<group>" is
-- set to the service ID (EX 3200) if it is absent or its owner has no liveness key
-- "{VERSE:STREAM:SHARDLOCK}:SERVICE_LIVENESS:<owner>", and bit i of the channel's flag is set.
-- A lock the caller holds while alive is not reported (Verse's script behaves so).
-- Returns {channel, flag, channel, flag, ...}.

local group_name = ARGV[1]
local service_id = ARGV[2]
local shard_count = tonumber(ARGV[3])

local out = {}
for s = 4, #ARGV do
  local channel = ARGV[s]
  local flag = 0
  for i = 0, shard_count - 1 do
    local key = '{VERSE:STREAM:SHARDLOCK}:' .. channel .. ':' .. i .. ':' .. group_name
    local owner = redis.call('GET', key)
    local take = owner == false
    if not take then
      take = not redis.call('GET', '{VERSE:STREAM:SHARDLOCK}:SERVICE_LIVENESS:' .. owner)
    end
    if take then
      redis.call('SET', key, service_id, 'EX', 3200)
      flag = flag + 2 ^ i
    end
  end
  if flag >= 2 ^ 31 then flag = flag - 2 ^ 32 end  -- bit.bor's result is a signed 32-bit int
  out[#out + 1] = channel
  out[#out + 1] = flag
end
return out
