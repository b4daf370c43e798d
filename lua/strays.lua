-- strays.lua: after a read, the shard streams holding entries pending for another consumer of
-- the group (a stale consumer's late read: docs/protocol.md, "Fenced delivery").
--
-- KEYS[1..n]  the shard streams just read (sent in the read's round trip, after XREADGROUP,
--             so that it runs after the read on the server)
-- ARGV[1]     consumer group
-- ARGV[2]     consumer ID of the reader (the shards' lock holder)
--
-- Calls XPENDING (summary form) on each stream. Returns a flat array, empty when no other
-- consumer has entries pending (the usual reply): for each stream that has some, its index in
-- KEYS (1-based) followed by the array of those consumers' names.

local group = ARGV[1]
local me = ARGV[2]

local found = {}
for i = 1, #KEYS do
  local summary = redis.call('XPENDING', KEYS[i], group)
  if summary[1] > 0 then
    local others = {}
    for _, row in ipairs(summary[4]) do
      if row[1] ~= me and tonumber(row[2]) > 0 then
        others[#others + 1] = row[1]
      end
    end
    if #others > 0 then
      found[#found + 1] = i
      found[#found + 1] = others
    end
  end
end
return found
