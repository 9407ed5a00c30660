-- take_one: the decision of one take, shared by take.lua (one take per call) and take_batch.lua
-- (many). Preceded by prelude.lua, token_bucket.lua and fixed_window.lua (see those headers for
-- the state).
--
-- take_one(k, a, n, now) decides the n buckets KEYS[k+1 .. k+n], whose 6 integers each start at
-- ARGV[a+1] (algorithm (0 token bucket, 1 fixed window), capacity, rate, period_ms, cost, lease),
-- at the clock reading `now` (µs), and appends to `out`:
--   1 when every bucket could pay and all were charged, 0 when none was charged;
--   then 6 per bucket: allowed (0/1), remaining, reset_ms, retry_after_ms, granted, mark
--   (granted = tokens charged, meaningful only when the take was charged; mark = the fixed window
--   index that was charged, for a refund; 0 for a token bucket).
--
-- Two phases: decide every bucket on scratch copies (a key named twice is charged twice, in
-- order, with the limits it was first named with in this take), then write only if all could pay. A denied take writes nothing. A take decided after
-- another in the same call reads what that one wrote.

local function take_one(k, a, n, now, out)
  local scratch = {}
  local head = #out + 1
  out[head] = 1
  local all = true
  for i = 1, n do
    local key = KEYS[k + i]
    local b = a + 6 * (i - 1)
    local alg = tonumber(ARGV[b + 1])
    local cap, rate, period, cost, lease = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]),
      tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5]), tonumber(ARGV[b + 6])
    local allowed, remaining, reset, retry, granted, mark
    local s = scratch[key]
    if alg == 0 then
      if s == nil then
        s = tb_load(key, cap, rate, period, now)
        tb_refill(s, cap, rate, period, now)
        s.alg, s.cap, s.rate, s.period = 0, cap, rate, period
        scratch[key] = s
      end
      allowed, remaining, reset, retry, granted = tb_take(s, cap, rate, period, cost, lease)
      mark = 0
    else
      if s == nil then
        s = fw_load(key, cap, period, now)
        s.alg, s.cap, s.period = 1, cap, period
        scratch[key] = s
      end
      allowed, remaining, reset, retry, granted = fw_take(s, cap, period, cost, lease)
      mark = s.w
    end
    if not allowed then all = false end
    out[#out + 1] = allowed and 1 or 0
    out[#out + 1] = remaining
    out[#out + 1] = reset
    out[#out + 1] = retry
    out[#out + 1] = granted
    out[#out + 1] = mark
  end

  if all then
    for skey, s in pairs(scratch) do
      if s.dirty then
        if s.alg == 0 then tb_store(skey, s, s.cap, s.rate, s.period) else fw_store(skey, s, s.cap, s.period) end
      end
    end
  else
    out[head] = 0
  end
  return out
end
