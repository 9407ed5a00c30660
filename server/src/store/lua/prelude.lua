-- Shared by every bucket script (concatenated in front of the algorithms and the driver by
-- server/src/store/redis/scripts.rs).
--
-- Exact integer arithmetic on Lua 5.1 numbers (IEEE doubles). Integers below 2^53 are exact, so
-- every quantity here is an integer: micro-tokens, microseconds, milliseconds. Products that may
-- pass 2^53 (elapsed time x rate, deficit x period) go through muldivmod, which never rounds.
-- Numbers handed to redis.call are formatted with fmt(): Lua's own tostring uses "%.14g" and
-- would silently round integers above 10^14.

local TWO52 = 4503599627370496
local B16 = 65536
local MICRO = 1000000
-- Reset and retry times are clamped here (about 285,000 years) so every reply is an exact integer.
local MAX_MS = 9007199254740991
-- Extra lifetime of a key beyond the moment it would be full again / its window ends.
local TTL_MARGIN_MS = 1000

local function fmt(n)
  return string.format('%.0f', n)
end

local TWO37 = 137438953472

-- floor((a * b + add) / c) and the remainder, exactly, for integers 0 <= a, b < 2^53,
-- 0 <= add < 2^52, 0 < c < 2^52. A quotient above 2^53 is approximate: callers compare it with a
-- capacity (at most 10^15 micro-tokens) or clamp it, so only its size matters then.
local function muldivmod(a, b, add, c)
  local x = a * b + add
  if x < TWO52 then
    -- x is exact; q may be off by one after the division's rounding, r fixes it.
    local q = math.floor(x / c)
    local r = x - q * c
    if r < 0 then q = q - 1; r = r + c elseif r >= c then q = q + 1; r = r - c end
    return q, r
  end
  -- Schoolbook product in base 2^16 limbs (p[0] lowest), then long division.
  local al, bl, p = {}, {}, {}
  for i = 0, 3 do
    al[i] = a % B16; a = (a - al[i]) / B16
    bl[i] = b % B16; b = (b - bl[i]) / B16
  end
  for k = 0, 7 do p[k] = 0 end
  for i = 0, 3 do
    for j = 0, 3 do p[i + j] = p[i + j] + al[i] * bl[j] end
  end
  p[0] = p[0] + add
  for k = 0, 6 do
    local carry = math.floor(p[k] / B16)
    p[k] = p[k] - carry * B16
    p[k + 1] = p[k + 1] + carry
  end
  local q, r = 0, 0
  if c < TWO37 then
    -- One limb per step: r < c < 2^37 keeps r * 2^16 + limb below 2^53.
    for k = 7, 0, -1 do
      local y = r * B16 + p[k]
      local d = math.floor(y / c)
      r = y - d * c
      if r < 0 then d = d - 1; r = r + c elseif r >= c then d = d + 1; r = r - c end
      q = q * B16 + d
    end
    return q, r
  end
  -- One bit per step: r < c < 2^52 keeps 2r + 1 exact.
  for k = 7, 0, -1 do
    local limb = p[k]
    local bit = 32768
    while bit >= 1 do
      local d = 0
      if limb >= bit then d = 1; limb = limb - bit end
      r = r * 2 + d
      q = q * 2
      if r >= c then r = r - c; q = q + 1 end
      bit = bit / 2
    end
  end
  return q, r
end

-- ceil(a * b / c), exact, clamped to MAX_MS.
local function ceil_ms(a, b, c)
  local q, r = muldivmod(a, b, 0, c)
  if r > 0 then q = q + 1 end
  if q > MAX_MS then q = MAX_MS end
  return q
end

-- The clock: Redis TIME, in microseconds. Never the caller's clock nor the service's.
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * MICRO + tonumber(t[2])
end

-- Shared by the fixed and the calendar window, whose loaded state is { w (the window counted),
-- count, reset (ms until it ends) } and whose arithmetic is contract::arithmetic::fixed_window's.
--
-- The most a window's count goes past its capacity: contract::bounds::MAX_DEBT.
local WINDOW_MAX_DEBT = 8000000000

-- Returns allowed, remaining, reset, retry, granted; when allowed, charges the scratch state
-- granted = min(lease, what the window has left), at least cost. A cost above the capacity is
-- told to retry in `never` ms (it never fits).
local function window_take(s, cap, cost, lease, never)
  local allowed = s.count + cost <= cap
  local retry, granted = 0, 0
  if allowed then
    granted = math.max(cost, math.min(lease, cap - s.count))
    s.count = s.count + granted
    s.dirty = true
  elseif cost > cap then
    retry = never
  else
    retry = s.reset
  end
  local remaining = cap - s.count
  if remaining < 0 then remaining = 0 end
  return allowed, remaining, s.reset, retry, granted
end

-- Gives `cost` back to window `w` (the window that was charged): nothing when the bucket has
-- moved on to another window since, or expired.
local function window_refund(key, w, cost)
  local v = redis.call('HMGET', key, 'w', 'n')
  local sw, n = tonumber(v[1]), tonumber(v[2])
  if sw == nil or n == nil or sw ~= w then return 0 end
  redis.call('HSET', key, 'n', fmt(n - math.min(n, cost)))
  return 1
end

-- Settles a reservation (settle.lua) on the loaded state `s`, only in the window the estimate was
-- charged in (`window`): a refund lowers its count (not below 0), an extra charge raises it in
-- full (to the capacity plus WINDOW_MAX_DEBT at most); a window that has ended is left alone (its
-- tokens ended with it). Without `window` (-1), an extra charge goes to the current window and a
-- refund is dropped (it might give back another window's tokens). `store(s)` writes a change.
-- Returns remaining, debt (the count above capacity).
local function window_settle(s, cap, estimate, used, window, apply, store)
  local here
  if window >= 0 then here = (window == s.w) else here = (used > estimate) end
  if apply and here then
    if used < estimate and s.count > 0 then
      s.count = s.count - math.min(s.count, estimate - used)
      store(s)
    elseif used > estimate then
      s.count = math.min(cap + WINDOW_MAX_DEBT, s.count + (used - estimate))
      store(s)
    end
  end
  return math.max(0, cap - s.count), math.max(0, s.count - cap)
end

-- The algorithms, by the code the service sends in ARGV (server/src/store/algorithm/). Each
-- algorithm's file registers one table here, and the drivers (take_one, refund, settle) call only
-- these functions, never an algorithm's internals. Every function gets the bucket's limits as the
-- caller sent them (an algorithm ignores those it does not use):
--   load(key, cap, rate, period, now) -> s       the state at `now` (µs), carried over to these
--                                                 limits when the hash recorded others; s.exists
--   take(s, cap, rate, period, cost, lease, max_delay)  decides on s, charging it (s.dirty) when
--     allowed -> allowed, remaining, reset_ms, retry_ms, granted, delay_ms (max_delay: shaping,
--     0 = none; only the token bucket shapes, the windows ignore it and answer no delay)
--   mark(s) -> integer                           what a refund of this charge needs (a window)
--   store(key, s, cap, rate, period)             HSET and PEXPIRE
--   refund(key, cap, rate, period, amount, mark, now) -> 0 or 1 (given back)
--   settle(key, cap, rate, period, now, estimate, used, window, apply) -> remaining, debt
--     (window: -1 when not known; apply: false for a settlement id seen before)
local ALGORITHMS = {}
