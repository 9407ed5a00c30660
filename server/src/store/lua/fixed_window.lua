-- Fixed window (algorithm 1): at most `capacity` tokens per window floor(now_ms / period_ms);
-- `rate` is ignored.
--
-- KEYS:  the bucket's base key, e.g. `tollgate:fw:{<key>}:<capacity>:<rate>:<period_ms>`. The
--        counter lives at `<base key>:<window index>`, derived here, inside the script: the suffix
--        comes after the `{hash tag}`, so it is in the same Redis Cluster slot as KEYS[i] (Redis
--        does not check undeclared keys of a script; the slot is what matters).
-- ARGV:  capacity, period_ms, cost, lease (integers validated by the service; cost <= lease).
-- State: a string counter (INCRBY). PEXPIRE when the counter is created: the window's end plus a
--        margin. A leaked counter could not matter anyway: the next window uses another key.
-- Clock: Redis TIME, in milliseconds.

local function fw_window(period, now)
  local now_ms = muldivmod(now, 1, 0, 1000)
  local w = muldivmod(now_ms, 1, 0, period)
  return w, (w + 1) * period - now_ms
end

local function fw_load(wkey)
  local v = redis.call('GET', wkey)
  return { count = tonumber(v) or 0, delta = 0 }
end

-- Returns allowed, remaining, reset, retry, granted; when allowed, charges the scratch state
-- granted = min(lease, what the window has left), at least cost.
local function fw_take(s, cap, period, cost, reset, lease)
  local allowed = s.count + cost <= cap
  local retry, granted = 0, 0
  if allowed then
    granted = math.max(cost, math.min(lease, cap - s.count))
    s.count = s.count + granted
    s.delta = s.delta + granted
    s.dirty = true
  elseif cost > cap then
    retry = period
  else
    retry = reset
  end
  local remaining = cap - s.count
  if remaining < 0 then remaining = 0 end
  return allowed, remaining, reset, retry, granted
end

local function fw_store(wkey, s, reset)
  local n = redis.call('INCRBY', wkey, fmt(s.delta))
  if n == s.delta then
    redis.call('PEXPIRE', wkey, fmt(reset + TTL_MARGIN_MS))
  end
end

-- Gives `cost` back to window `w` (the window that was charged, not the current one).
local function fw_refund(base, w, cost)
  local wkey = base .. ':' .. fmt(w)
  local v = tonumber(redis.call('GET', wkey))
  if v == nil then return 0 end
  redis.call('DECRBY', wkey, fmt(math.min(v, cost)))
  return 1
end
