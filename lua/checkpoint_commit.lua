-- checkpoint_commit.lua: advance a shard's checkpoint past a stored segment or a gap (fenced).
--
-- KEYS[1]  locks        offloader lock hash: "<shard>" -> owner, "<shard>:token" -> fencing token
-- KEYS[2]  checkpoints  hash: "<shard>" -> last archived ID, "<shard>:pending" -> intent,
--                       "<shard>:count" -> entries accounted for
-- ARGV[1]  shard
-- ARGV[2]  offloader ID of the caller
-- ARGV[3]  the caller's fencing token
-- ARGV[4]  last entry ID of the stored segment (or of a gap)
-- ARGV[5]  entries accounted for by it (archived rows, or lost entries of a gap)
--
-- Clears the pending intent, sets the checkpoint to ARGV[4] and adds ARGV[5] to the count; never
-- moves the checkpoint backwards (a replayed commit adds nothing).
-- Returns 1 (advanced), 2 (already at or past it), 0 (fenced off: nothing changed).
-- Entry IDs are compared exactly as integer pairs, never as Lua (floating-point) numbers.

local locks = KEYS[1]
local cps = KEYS[2]
local shard = ARGV[1]
local me = ARGV[2]
local token = ARGV[3]
local last = ARGV[4]
local entries = tonumber(ARGV[5])

-- digit strings compared by length, then text
local function cmp_num(a, b)
  if #a ~= #b then return (#a < #b) and -1 or 1 end
  if a == b then return 0 end
  return (a < b) and -1 or 1
end

local function cmp_id(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  local c = cmp_num(am, bm)
  if c ~= 0 then return c end
  return cmp_num(as, bs)
end

if redis.call('HGET', locks, shard) ~= me
    or redis.call('HGET', locks, shard .. ':token') ~= token then
  return 0
end
redis.call('HDEL', cps, shard .. ':pending')
local cp = redis.call('HGET', cps, shard)
if cp and cmp_id(last, cp) <= 0 then return 2 end
redis.call('HSET', cps, shard, last)
redis.call('HINCRBY', cps, shard .. ':count', entries)
return 1
