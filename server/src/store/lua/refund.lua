-- refund: give back tokens take.lua charged: after another Redis Cluster slot of the same request
-- denied (or failed), or a lease that ended unspent (POST /v1/refund, token buckets, mark 0).
-- Preceded by prelude.lua and every algorithm's file (ALGORITHMS[code].refund).
--
-- KEYS:  the keys of the buckets that were charged (one slot).
-- ARGV:  6 integers per bucket, at 6*(i-1)+1 ..: algorithm, capacity, rate, period_ms, amount, mark
--        (amount = the `granted` tokens take.lua charged; mark = take.lua's mark: the window
--        index charged).
-- Reply: {the number of buckets given back}. A bucket whose key has expired meanwhile
--        is already full (token bucket) or in a past window (the windows): nothing to give back.
-- Clock: Redis TIME (the token bucket refills up to now before the cost is added back, capped at
--        capacity, so a refund never leaves more than the bucket would hold had it not been charged).

local now = now_us()
local n = 0
for i = 1, #KEYS do
  local b = 6 * (i - 1)
  local alg = tonumber(ARGV[b + 1])
  local cap, rate, period, cost, mark = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]),
    tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5]), tonumber(ARGV[b + 6])
  n = n + ALGORITHMS[alg].refund(KEYS[i], cap, rate, period, cost, mark, now)
end
-- An array, as the scripts other than the takes reply (the service reads an array or a take's packed
-- string alike, reply::Ints).
return {n}
