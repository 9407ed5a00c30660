-- Fixed window (algorithm 1, ALGORITHMS[1]; contract/src/arithmetic/fixed_window.rs is the
-- reference arithmetic, server/tests/integration/lua_reference.rs compares them): at most `capacity` tokens per window floor(now_ms / period_ms);
-- `rate` is ignored.
--
-- KEYS:  the bucket's hash, e.g. `tollgate:fw:{<key>}`: algorithm and key only, not the limits.
-- ARGV:  capacity, period_ms, cost, lease (integers validated by the service; cost <= lease).
-- State: HSET fields, integers formatted exactly:
--          w = the window index counted (floor(now_ms / p)), n = tokens used in it,
--          c, p = the capacity and period_ms it was counted with.
--        PEXPIRE on every write: the window's end plus a margin (a missing hash is an unused window).
-- A changed limit keeps the count: the stored count carries over while the window it was counted
-- in has not ended (under the old period; a new period starts its first window with what the old
-- window used), scaled to the new capacity keeping the fraction used: n' = ceil(n * capacity / c).
-- So lowering 100 -> 50 with 40 used leaves 30 of 50; nothing is handed out twice in a window.
-- Clock: Redis TIME, in milliseconds. A clock that steps back keeps counting in the newest window.

local function fw_window(period, now)
  local now_ms = muldivmod(now, 1, 0, 1000)
  local w = muldivmod(now_ms, 1, 0, period)
  return w, now_ms
end

-- The window state at `now` for the caller's limits: { w, count, reset }.
local function fw_load(key, cap, period, now)
  local w, now_ms = fw_window(period, now)
  local v = redis.call('HMGET', key, 'w', 'n', 'c', 'p')
  local sw, n, c, p = tonumber(v[1]), tonumber(v[2]), tonumber(v[3]), tonumber(v[4])
  local count = 0
  if sw ~= nil and n ~= nil and c ~= nil and p ~= nil then
    if p == period then
      if sw >= w then count = n; w = sw end
    elseif now_ms < (sw + 1) * p then
      count = n
    end
    if count > 0 and c ~= cap then
      local q, r = muldivmod(count, cap, 0, c)
      if r > 0 then q = q + 1 end
      count = q
    end
  end
  return { w = w, count = count, reset = (w + 1) * period - now_ms }
end

local function fw_store(key, s, cap, period)
  redis.call('HSET', key, 'w', fmt(s.w), 'n', fmt(s.count), 'c', fmt(cap), 'p', fmt(period))
  redis.call('PEXPIRE', key, fmt(s.reset + TTL_MARGIN_MS))
end

-- Settles a reservation (settle.lua): `window_settle` (prelude.lua) on the window at `now`.
local function fw_settle(key, cap, rate, period, now, estimate, used, window, apply)
  local s = fw_load(key, cap, period, now)
  return window_settle(s, cap, estimate, used, window, apply,
    function(st) fw_store(key, st, cap, period) end)
end

ALGORITHMS[1] = {
  load = function(key, cap, rate, period, now) return fw_load(key, cap, period, now) end,
  take = function(s, cap, rate, period, cost, lease) return window_take(s, cap, cost, lease, period) end,
  mark = function(s) return s.w end,
  store = function(key, s, cap, rate, period) fw_store(key, s, cap, period) end,
  refund = function(key, cap, rate, period, amount, mark, now) return window_refund(key, mark, amount) end,
  settle = fw_settle,
}
