-- settle: the second half of "reserve, then settle" (POST /v1/settle, Settle). A take charged an
-- estimate when the request arrived; now the response has said what it used, and the difference
-- is settled in the same buckets, once per settlement id. Preceded by prelude.lua,
-- token_bucket.lua and fixed_window.lua.
--
-- KEYS:  [1] the settlement id's record, `<prefix>settled:{<tag>}:<id>`, with the hash tag of the
--        buckets' keys (so it is in their slot on a Redis Cluster);
--        [2..] the buckets' keys (one slot).
-- ARGV:  [1] how long the id is remembered, ms; then 7 integers per bucket, at 1 + 7*(i-1) + 1 ..:
--        algorithm, capacity, rate, period_ms, estimate, used, window (-1: not known).
-- Reply: {duplicate (0/1), then per bucket: remaining, debt}.
--        duplicate = 1: the id's record existed, nothing was changed; the buckets report how
--        they stand.
-- Semantics, per bucket:
--   token bucket: refilled up to now, then used < estimate gives back the difference (capped at
--     capacity; an expired bucket is full already and takes none), used > estimate charges it,
--     down to minus the capacity at most (t >= -c * 10^6): the debt, which takes exactly as long
--     to refill as the following takes are told to wait (tb_take counts the whole deficit).
--   fixed window: only in the window the estimate was charged in (`window`): a refund lowers its
--     count (not below 0), an extra charge raises it, to twice the capacity at most; a window that
--     has ended is left alone (its tokens ended with it). Without `window`, an extra charge goes
--     to the current window and a refund is dropped (it might give back another window's tokens).
-- Clock: Redis TIME. Every write sets a TTL: the id's record PX, the buckets PEXPIRE (until full
--   again, or the window's end, plus a margin).

local now = now_us()
-- SET NX answers false (a nil reply) when the record exists: this id was applied already.
local fresh = redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1])
local out = { 0 }
if not fresh then out[1] = 1 end

for i = 2, #KEYS do
  local key = KEYS[i]
  local b = 1 + 7 * (i - 2)
  local alg = tonumber(ARGV[b + 1])
  local cap, rate, period = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
  local estimate, used, window = tonumber(ARGV[b + 5]), tonumber(ARGV[b + 6]), tonumber(ARGV[b + 7])
  local remaining, debt = 0, 0
  if alg == 0 then
    local s = tb_load(key, cap, rate, period, now)
    tb_refill(s, cap, rate, period, now)
    if fresh then
      local cap_m = cap * MICRO
      if used < estimate and s.exists then
        s.t = math.min(cap_m, s.t + (estimate - used) * MICRO)
        tb_store(key, s, cap, rate, period)
      elseif used > estimate then
        s.t = math.max(-cap_m, s.t - (used - estimate) * MICRO)
        tb_store(key, s, cap, rate, period)
      end
    end
    remaining = tb_whole(s)
    if s.t < 0 then
      local q, r = muldivmod(-s.t, 1, 0, MICRO)
      if r > 0 then q = q + 1 end
      debt = q
    end
  else
    local s = fw_load(key, cap, period, now)
    local here
    if window >= 0 then here = (window == s.w) else here = (used > estimate) end
    if fresh and here then
      if used < estimate and s.count > 0 then
        s.count = s.count - math.min(s.count, estimate - used)
        fw_store(key, s, cap, period)
      elseif used > estimate then
        s.count = math.min(2 * cap, s.count + (used - estimate))
        fw_store(key, s, cap, period)
      end
    end
    remaining = math.max(0, cap - s.count)
    debt = math.max(0, s.count - cap)
  end
  out[#out + 1] = remaining
  out[#out + 1] = debt
end
return out
