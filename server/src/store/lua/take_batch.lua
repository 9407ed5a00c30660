-- take_batch: decide several takes in one call, each exactly as take.lua decides one: atomic and
-- all-or-nothing within itself, independent of the others, in order (a later take sees what an
-- earlier one charged). Preceded by prelude.lua, every algorithm's file and take_one.lua.
--
-- KEYS:  the buckets of take 1, then those of take 2, ... (on a cluster, all of one slot).
-- ARGV:  [1] = T, the number of takes; [2 .. T+1] = the number of buckets of each take; then 7
--        integers per bucket, in KEYS order, as in take.lua.
-- Reply: the replies of take.lua for each take, one after the other (1 + 7 * n integers for a take
--        of n buckets), packed as take.lua's.
-- Clock: one Redis TIME read per call, shared by all takes.

-- Each bucket is read once and written once per call however many takes name it (take_one's
-- `batch`).

local t = tonumber(ARGV[1])
local now = now_us()
local out = {}
local batch = {}
local k, a = 0, 1 + t
for j = 1, t do
  local n = tonumber(ARGV[1 + j])
  take_one(k, a, n, now, out, batch)
  k = k + n
  a = a + 7 * n
end
flush_batch(batch)
return packed(out)
