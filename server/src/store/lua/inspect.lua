-- inspect: read one bucket, or one concurrency key's slot set, as it stands on the Redis clock,
-- writing nothing (GET /v1/buckets). Preceded by prelude.lua and every algorithm's file.
--
-- KEYS:  one key: the bucket's hash (`<prefix><alg>:{<key>}`) or the slot set (`<prefix>cc:{<key>}`).
-- ARGV:  a bucket: algorithm code, capacity, rate, period_ms (the limits it is read under; a
--        hash charged with other limits is carried over to these, as a take would);
--        a slot set: -1.
-- Reply: a bucket: {exists (0/1), remaining, debt, reset_ms}: what a take would find now.
--          remaining and reset_ms come from the algorithm's take asked for capacity + 1 tokens,
--          which can never be paid and so charges nothing (ms until full, or until the window
--          ends); debt from its settle asked to apply nothing.
--        a slot set: {in_flight, then the ms until each live slot's deadline, soonest first, at
--          most 100}. Released names (negative scores) and expired slots are not counted, and
--          are left for acquire.lua to remove.
-- Clock: Redis TIME, read once. Writes: none (no HSET, no PEXPIRE, no ZREM).

local alg = tonumber(ARGV[1])
local key = KEYS[1]
if alg < 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local out = { redis.call('ZCOUNT', key, '(' .. fmt(now), '+inf') }
  local live = redis.call('ZRANGEBYSCORE', key, '(' .. fmt(now), '+inf', 'WITHSCORES', 'LIMIT', 0, 100)
  for i = 2, #live, 2 do
    out[#out + 1] = tonumber(live[i]) - now
  end
  return out
end
local now = now_us()
local a = ALGORITHMS[alg]
local cap, rate, period = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local s = a.load(key, cap, rate, period, now)
local exists = redis.call('EXISTS', key)
local _, remaining, reset_ms = a.take(s, cap, rate, period, cap + 1, cap + 1)
local _, debt = a.settle(key, cap, rate, period, now, 0, 0, -1, false)
return { exists, remaining, debt, reset_ms }
