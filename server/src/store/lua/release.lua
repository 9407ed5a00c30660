-- release: give back the concurrency slot ARGV[1] of every key.
--
-- KEYS[1..n]  the keys' slot sets (see acquire.lua); on a Cluster all in one hash slot.
-- ARGV[1]     the slot id acquire.lua stored.
-- Clock       not read: a release removes one member and nothing else.
-- Reply       per key: 1 if the slot was still held, 0 if it had expired or was released before.
-- Writes      ZREM only. The set keeps the TTL acquire.lua gave it; Redis deletes it when empty.

local out = {}
for i, key in ipairs(KEYS) do
  out[i] = redis.call('ZREM', key, ARGV[1])
end
return out
