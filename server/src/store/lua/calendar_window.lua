-- Calendar window (algorithm 3, ALGORITHMS[3]; contract/src/arithmetic/calendar_window.rs is the
-- reference arithmetic, server/tests/integration/lua_reference.rs compares them): at most
-- `capacity` tokens per calendar period (a day, a week, a month, a year from midnight in a zone).
--
-- KEYS:  the bucket's hash, e.g. `tollgate:cw:{<key>}`: algorithm and key only, not the limits.
-- ARGV:  capacity, then the span the service computed from the bucket's calendar and zone
--        (contract::calendar::Span) in the rate and period places: the boundary nearest the
--        service's clock (ms since the epoch) and the lengths of the windows either side of it in
--        seconds (before * 2^26 + after); cost, lease.
-- State: HSET fields, integers formatted exactly:
--          w = the counted window's first ms, n = tokens used in it, c = the capacity counted with.
--        PEXPIRE on every write: the window's end plus a margin (a missing hash is an unused window).
-- The window is picked from the span by Redis TIME: before the boundary, the window that ends at
-- it; from it on, the one that starts there. A window later than the stored one starts at 0; a
-- clock behind the stored window keeps counting in that one. A changed capacity keeps the fraction
-- used (n' = ceil(n * capacity / c)), as the fixed window does.

local CW_SHIFT = 67108864

-- The window of `now_ms` in the span: its first ms and its end, and the end of the window after
-- the boundary (where a stored window later than the clock's ends).
local function cw_window(boundary, lengths, now_ms)
  local after = (lengths % CW_SHIFT) * 1000
  local before = ((lengths - lengths % CW_SHIFT) / CW_SHIFT) * 1000
  if now_ms < boundary then
    return math.max(0, boundary - before), boundary, boundary + after
  end
  return boundary, boundary + after, boundary + after
end

-- The window state at `now` for the caller's limits: { w, count, reset }.
local function cw_load(key, cap, boundary, lengths, now)
  local now_ms = muldivmod(now, 1, 0, 1000)
  local start, ends, later = cw_window(boundary, lengths, now_ms)
  local v = redis.call('HMGET', key, 'w', 'n', 'c')
  local sw, n, c = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  local w, count = start, 0
  if sw ~= nil and n ~= nil and c ~= nil and sw >= start then
    w, count = sw, n
    if sw > start then ends = later end
    -- ceil(n * capacity / c), exact below 2^53 (a count in debt scaled far up is clamped there).
    if count > 0 and c ~= cap then count = ceil_ms(count, cap, c) end
  end
  return { w = w, count = count, reset = math.max(0, ends - now_ms) }
end

local function cw_store(key, s, cap)
  redis.call('HSET', key, 'w', fmt(s.w), 'n', fmt(s.count), 'c', fmt(cap))
  redis.call('PEXPIRE', key, fmt(s.reset + TTL_MARGIN_MS))
end

-- Settles a reservation (settle.lua): `window_settle` (prelude.lua) on the window at `now`.
local function cw_settle(key, cap, boundary, lengths, now, estimate, used, window, apply)
  local s = cw_load(key, cap, boundary, lengths, now)
  return window_settle(s, cap, estimate, used, window, apply, function(st) cw_store(key, st, cap) end)
end

ALGORITHMS[3] = {
  load = function(key, cap, rate, period, now) return cw_load(key, cap, rate, period, now) end,
  take = function(s, cap, rate, period, cost, lease)
    return window_take(s, cap, cost, lease, s.reset)
  end,
  mark = function(s) return s.w end,
  store = function(key, s, cap, rate, period) cw_store(key, s, cap) end,
  refund = function(key, cap, rate, period, amount, mark, now) return window_refund(key, mark, amount) end,
  settle = cw_settle,
}
