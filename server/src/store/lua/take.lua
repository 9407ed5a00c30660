-- take: charge every bucket of one request (of one Redis Cluster slot), all or none.
-- Preceded by prelude.lua, token_bucket.lua and fixed_window.lua (see those headers for the state).
--
-- KEYS:  KEYS[i] = bucket i (every key carries the same {hash tag} slot on a cluster).
-- ARGV:  6 integers per bucket i, at 6*(i-1)+1 ..: algorithm (0 token bucket, 1 fixed window),
--        capacity, rate, period_ms, cost, lease (= cost when no lease was asked for).
-- Reply: an array of integers (never floats: every value is built integral and below 2^53):
--        [1] = 1 when every bucket could pay and all were charged, 0 when none was charged;
--        then 6 per bucket: allowed (0/1), remaining, reset_ms, retry_after_ms, granted, mark
--        (granted = tokens charged, meaningful only when [1] = 1; mark = the fixed window index
--        that was charged, for a refund; 0 for a token bucket).
-- Clock: one Redis TIME read per call, shared by all buckets.
--
-- Two phases: decide every bucket on scratch copies (a key named twice is charged twice, in
-- order), then write only if all could pay. A denied request writes nothing.

local now = now_us()
local scratch = {}
local out = { 1 }
local all = true

for i = 1, #KEYS do
  local b = 6 * (i - 1)
  local alg = tonumber(ARGV[b + 1])
  local cap, rate, period, cost, lease = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]),
    tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5]), tonumber(ARGV[b + 6])
  local allowed, remaining, reset, retry, granted, mark
  if alg == 0 then
    local s = scratch[KEYS[i]]
    if s == nil then
      s = tb_load(KEYS[i], cap, now)
      tb_refill(s, cap, rate, period, now)
      s.alg, s.cap, s.rate, s.period = 0, cap, rate, period
      scratch[KEYS[i]] = s
    end
    allowed, remaining, reset, retry, granted = tb_take(s, cap, rate, period, cost, lease)
    mark = 0
  else
    local w, window_reset = fw_window(period, now)
    local wkey = KEYS[i] .. ':' .. fmt(w)
    local s = scratch[wkey]
    if s == nil then
      s = fw_load(wkey)
      s.alg, s.reset = 1, window_reset
      scratch[wkey] = s
    end
    allowed, remaining, reset, retry, granted = fw_take(s, cap, period, cost, window_reset, lease)
    mark = w
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
  for key, s in pairs(scratch) do
    if s.dirty then
      if s.alg == 0 then tb_store(key, s, s.cap, s.rate, s.period) else fw_store(key, s, s.reset) end
    end
  end
else
  out[1] = 0
end
return out
