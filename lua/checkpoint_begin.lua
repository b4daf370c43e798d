-- checkpoint_begin.lua: record the intent to write segment first..last of a shard (fenced).
--
-- KEYS[1]  locks        offloader lock hash: "<shard>" -> owner, "<shard>:token" -> fencing token
-- KEYS[2]  checkpoints  hash: "<shard>" -> last archived ID, "<shard>:pending" -> intent,
--                       "<shard>:count" -> entries accounted for
-- ARGV[1]  shard
-- ARGV[2]  offloader ID of the caller
-- ARGV[3]  the caller's fencing token
-- ARGV[4]  first entry ID of the segment
-- ARGV[5]  last entry ID of the segment
-- ARGV[6]  entries in the segment
--
-- Returns 1 (intent recorded as "<first> <last> <entries>"), 0 (the caller does not hold the
-- lock with this token: fenced off), {2, pending} when another intent is pending (finish that
-- one first), or {3, checkpoint} when first is not after the checkpoint (a stale buffer).
-- Entry IDs are compared exactly as integer pairs, never as Lua (floating-point) numbers.

local locks = KEYS[1]
local cps = KEYS[2]
local shard = ARGV[1]
local me = ARGV[2]
local token = ARGV[3]
local first = ARGV[4]
local last = ARGV[5]
local entries = ARGV[6]

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
local pending = redis.call('HGET', cps, shard .. ':pending')
if pending then return {2, pending} end
local cp = redis.call('HGET', cps, shard)
if cp and cmp_id(first, cp) <= 0 then return {3, cp} end
redis.call('HSET', cps, shard .. ':pending', first .. ' ' .. last .. ' ' .. entries)
return 1
