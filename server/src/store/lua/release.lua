-- release: give back the concurrency slot ARGV[1] of every key.
--
-- KEYS[1..n]  the keys' slot sets (see acquire.lua); on a Cluster all in one hash slot.
-- ARGV[1]     the slot id acquire.lua stored.
-- ARGV[2]     how long a name released before its slot was taken is remembered, in ms.
-- Clock       Redis TIME, read once (for what a name not found is remembered until).
-- Reply       per key: 1 if the slot was still held, 0 if it had expired, was released before, or
--             was never taken.
-- Writes      ZREM of the slot. A name not found is remembered (member '~' .. id, score minus the
--             time it is remembered until) so that its acquire, if it arrives late (a caller's
--             release can overtake its own acquire), takes nothing; the set then lives at least as
--             long. Otherwise the set keeps the TTL acquire.lua gave it; Redis deletes it when empty.

local out = {}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local memory = tonumber(ARGV[2])
for i, key in ipairs(KEYS) do
  out[i] = redis.call('ZREM', key, ARGV[1])
  if out[i] == 0 then
    redis.call('ZADD', key, -(now + memory), '~' .. ARGV[1])
    if redis.call('PTTL', key) < memory then
      redis.call('PEXPIRE', key, memory)
    end
  end
end
return out
