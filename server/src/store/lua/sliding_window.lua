-- Sliding window counter (algorithm 2, ALGORITHMS[2]; contract/src/arithmetic/sliding_window.rs
-- is the reference arithmetic, server/tests/integration/lua_reference.rs compares them): a window of `period_ms` that slides with the clock, estimated from
-- two fixed windows as the current window's count plus the previous window's count weighted by
-- the part of it the sliding window still covers:
--   used = n + ceil(m * (period - elapsed) / period)     (elapsed: ms into the current window)
-- A take of `cost` is admitted when used + cost <= capacity; `rate` is ignored.
--
-- KEYS:  the bucket's hash, e.g. `tollgate:sw:{<key>}`: algorithm and key only, not the limits.
-- ARGV:  capacity, period_ms, cost, lease (integers validated by the service; cost <= lease).
-- State: HSET fields, integers formatted exactly:
--          w = the current window index (floor(now_ms / p)), n = tokens counted in it,
--          m = tokens counted in window w - 1, c, p = the capacity and period_ms counted with.
--        PEXPIRE on every write: the end of window w + 1 (until then n still weighs) plus a
--        margin; a missing hash is a window with nothing counted.
-- A changed limit keeps the count, as a fixed window's does: with the same period n and m are
-- scaled to the new capacity keeping the fraction used (rounded up); with another period the
-- estimate under the old limits becomes the new current window's count (scaled likewise).
-- Clock: Redis TIME, in milliseconds. A clock that steps back keeps counting in the newest window.

local function sw_window(period, now)
  local now_ms = muldivmod(now, 1, 0, 1000)
  return muldivmod(now_ms, 1, 0, period), now_ms
end

-- ceil(a * b / c), exact.
local function sw_ceil(a, b, c)
  local q, r = muldivmod(a, b, 0, c)
  if r > 0 then q = q + 1 end
  return q
end

-- Moves s to window w (a window behind s.w keeps counting in s.w).
local function sw_roll(s, w)
  if w == s.w + 1 then
    s.m = s.n; s.n = 0; s.w = w
  elseif w > s.w then
    s.m = 0; s.n = 0; s.w = w
  end
end

-- ms into window s.w at now_ms: 0 when the clock is behind it, at most a period.
local function sw_elapsed(s, period, now_ms)
  local e = now_ms - s.w * period
  if e < 0 then e = 0 elseif e > period then e = period end
  return e
end

-- The estimate at now_ms.
local function sw_used(s, period, now_ms)
  return s.n + sw_ceil(s.m, period - sw_elapsed(s, period, now_ms), period)
end

-- The first elapsed into a window at which `weight` counted in the window before leaves `room`.
local function sw_room_at(weight, room, period)
  if weight == 0 then return 0 end
  return period - muldivmod(room, period, 0, weight)
end

local function sw_scale(count, cap, c)
  if count == 0 or c == cap then return count end
  return sw_ceil(count, cap, c)
end

local function sw_load(key, cap, rate, period, now)
  local w, now_ms = sw_window(period, now)
  local s = { w = w, n = 0, m = 0, now_ms = now_ms }
  local v = redis.call('HMGET', key, 'w', 'n', 'm', 'c', 'p')
  local sw, n, m = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  local c, p = tonumber(v[4]), tonumber(v[5])
  if sw ~= nil and n ~= nil and m ~= nil and c ~= nil and p ~= nil then
    local old = { w = sw, n = n, m = m }
    sw_roll(old, muldivmod(now_ms, 1, 0, p))
    if p == period then
      s.w = old.w
      s.n = sw_scale(old.n, cap, c)
      s.m = sw_scale(old.m, cap, c)
    else
      s.n = sw_scale(sw_used(old, p, now_ms), cap, c)
    end
  end
  return s
end

-- ms until nothing counted weighs any more.
local function sw_reset(s, period)
  if s.n > 0 then return (s.w + 2) * period - s.now_ms end
  if s.m > 0 then return (s.w + 1) * period - s.now_ms end
  return 0
end

local function sw_take(s, cap, rate, period, cost, lease)
  local used = sw_used(s, period, s.now_ms)
  local allowed = used + cost <= cap
  local retry, granted = 0, 0
  if allowed then
    granted = math.max(cost, math.min(lease, cap - used))
    s.n = s.n + granted
    s.dirty = true
  elseif cost > cap then
    retry = period
  elseif s.n <= cap - cost then
    -- The current count leaves room: wait for the previous window to slide out enough.
    retry = s.w * period + sw_room_at(s.m, cap - cost - s.n, period) - s.now_ms
    if retry < 1 then retry = 1 end
  else
    -- Not in this window: in the next one, this window's count slides out.
    retry = (s.w + 1) * period + sw_room_at(s.n, cap - cost, period) - s.now_ms
  end
  if retry > MAX_MS then retry = MAX_MS end
  local remaining = cap - sw_used(s, period, s.now_ms)
  if remaining < 0 then remaining = 0 end
  return allowed, remaining, sw_reset(s, period), retry, granted
end

local function sw_store(key, s, cap, rate, period)
  redis.call('HSET', key, 'w', fmt(s.w), 'n', fmt(s.n), 'm', fmt(s.m), 'c', fmt(cap),
    'p', fmt(period))
  redis.call('PEXPIRE', key, fmt((s.w + 2) * period - s.now_ms + TTL_MARGIN_MS))
end

-- The field counting window `w` while it still weighs ('n' current, 'm' previous), or nil.
local function sw_field(s, w)
  if w == s.w then return 'n' end
  if w + 1 == s.w then return 'm' end
  return nil
end

-- Gives `amount` back to window `mark` (the one charged) while it still weighs.
local function sw_refund(key, cap, rate, period, amount, mark, now)
  local s = sw_load(key, cap, rate, period, now)
  local f = sw_field(s, mark)
  if f == nil then return 0 end
  s[f] = s[f] - math.min(s[f], amount)
  sw_store(key, s, cap, rate, period)
  return 1
end

-- The most a window's count goes past its capacity: contract::bounds::MAX_DEBT.
local SW_MAX_DEBT = 8000000000

-- Settles a reservation (settle.lua) in the window the estimate was charged in (`window`) while
-- it still weighs (the current or the previous one): a refund lowers its count (not below 0), an
-- extra charge raises it in full (to the capacity plus SW_MAX_DEBT at most). Without `window` (-1), an extra charge
-- counts in the current window and a refund is dropped. Returns remaining, debt (the estimate
-- above capacity).
local function sw_settle(key, cap, rate, period, now, estimate, used, window, apply)
  local s = sw_load(key, cap, rate, period, now)
  local f = nil
  if window >= 0 then f = sw_field(s, window) elseif used > estimate then f = 'n' end
  if apply and f ~= nil then
    if used < estimate and s[f] > 0 then
      s[f] = s[f] - math.min(s[f], estimate - used)
      sw_store(key, s, cap, rate, period)
    elseif used > estimate then
      s[f] = math.min(cap + SW_MAX_DEBT, s[f] + (used - estimate))
      sw_store(key, s, cap, rate, period)
    end
  end
  local u = sw_used(s, period, s.now_ms)
  return math.max(0, cap - u), math.max(0, u - cap)
end

ALGORITHMS[2] = {
  load = sw_load,
  take = sw_take,
  mark = function(s) return s.w end,
  store = sw_store,
  refund = sw_refund,
  settle = sw_settle,
}
