-- settle: the second half of "reserve, then settle" (POST /v1/settle, Settle). A take charged an
-- estimate when the request arrived; now the response has said what it used, and the difference
-- is settled in the same buckets, once per settlement id. Preceded by prelude.lua and every
-- algorithm's file: each bucket is settled by ALGORITHMS[code].settle (what that does, per
-- algorithm, is in its file and in contract/README.md, "Settle").
--
-- KEYS:  [1] the settlement id's record, `<prefix>settled:{<tag>}:<id>`, with the hash tag of the
--        buckets' keys (so it is in their slot on a Redis Cluster);
--        [2..] the buckets' keys (one slot).
-- ARGV:  [1] how long the id is remembered, ms; then 7 integers per bucket, at 1 + 7*(i-1) + 1 ..:
--        algorithm, capacity, rate, period_ms, estimate, used, window (-1: not known).
-- Reply: {duplicate (0/1), then per bucket: remaining, debt}.
--        duplicate = 1: the id's record existed, nothing was changed; the buckets report how
--        they stand.
-- Clock: Redis TIME. Every write sets a TTL: the id's record PX, the buckets PEXPIRE (until full
--   again, or the window's end, plus a margin).

local now = now_us()
-- SET NX answers false (a nil reply) when the record exists: this id was applied already.
local fresh = redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1])
local out = { 0 }
if not fresh then out[1] = 1 end

for i = 2, #KEYS do
  local b = 1 + 7 * (i - 2)
  local alg = ALGORITHMS[tonumber(ARGV[b + 1])]
  local cap, rate, period = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
  local estimate, used, window = tonumber(ARGV[b + 5]), tonumber(ARGV[b + 6]), tonumber(ARGV[b + 7])
  local remaining, debt = alg.settle(KEYS[i], cap, rate, period, now, estimate, used, window, fresh)
  out[#out + 1] = remaining
  out[#out + 1] = debt
end
return out
