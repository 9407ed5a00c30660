-- Token bucket (algorithm 0, ALGORITHMS[0]; contract/src/arithmetic/token_bucket.rs is the
-- reference arithmetic, server/tests/integration/lua_reference.rs compares them): holds at most `capacity` tokens, refills continuously at
-- `rate` per `period_ms`, starts full.
--
-- KEYS:  the bucket's hash, e.g. `tollgate:tb:{<key>}`: algorithm and key only, not the limits.
-- ARGV:  capacity, rate, period_ms, cost, lease, max_delay_ms (integers validated by the service:
--        1..1e9, period <= 1 year, cost <= lease; lease = cost when the caller asked for no lease;
--        max_delay_ms 0..=60000, 0 = no shaping).
-- Shaping: a cost the bucket cannot pay now whose tokens refill within max_delay_ms is charged
--        now, t going below zero by the deficit (at most rate * max_delay_ms / period_ms tokens),
--        and answered with delay_ms = the time until they are there (rounded up, as a retry
--        time); a longer wait is denied as without shaping. Each later take waits for its tokens
--        after those, so grants are spaced as the refill allows, in the order Redis ran them.
--        The TTL (time until full + margin) counts from the level below zero: it covers the debt.
-- State: HSET fields, all integers formatted exactly:
--          t  = micro-tokens held (MAX_DEBT_M ..= c * 10^6: below zero while the bucket owes
--               tokens after a settle charged more than it held, see settle.lua, or after
--               shaping granted tokens ahead of their refill)
--          ts = Redis TIME of the last charge, microseconds
--          f  = refill remainder, in 1/p of a micro-token (0 .. p - 1), so no fraction of a token
--               is ever lost between charges: the refill is exact, not rounded per call
--          c, r, p = the capacity, rate and period_ms the bucket was last charged with (written
--               only when they change: a write under the limits the hash holds sets t, ts, f)
--        A missing hash is a full bucket; that is why expiry (PEXPIRE = time until full + margin,
--        set on every write) can never admit more than the limit.
-- A changed limit keeps the count: when the caller's limits differ from (c, r, p), the bucket is
-- first refilled up to now with the limits it had, then its tokens are scaled to the new capacity
-- keeping the fraction held: t' = floor(t * capacity / c) (so the fraction used is kept, rounded
-- against the caller, never above the new capacity); the refill remainder restarts at 0 (less than
-- one micro-token is dropped). Lowering 100 -> 50 with 60 left leaves 30; raising 50 -> 100 with
-- 30 left gives 60. A rollout therefore hands no one a fresh burst.
-- Clock: Redis TIME. If it steps back (a failover), the bucket does not refill until it passes `ts`.
-- Registered in ALGORITHMS[0] (the interface is in prelude.lua); the replies are built by the
-- drivers.

-- The lowest balance: minus contract::bounds::MAX_DEBT (8e9 tokens) in micro-tokens, so that
-- (capacity + debt) * 10^6 stays below 2^53 (exact).
local MAX_DEBT_M = -8000000000000000

-- Adds the micro-tokens earned between s.ts and now: elapsed_us * rate * 10^6 / (period_ms * 1000)
-- = floor((elapsed_us * rate * 1000 + f) / period_ms), the remainder kept in f.
local function tb_refill(s, cap, rate, period, now)
  if now <= s.ts then return end
  local cap_m = cap * MICRO
  if s.t >= cap_m then
    s.t = cap_m; s.f = 0
  else
    local add, f = muldivmod(now - s.ts, rate * 1000, s.f, period)
    if add >= cap_m - s.t then s.t = cap_m; s.f = 0 else s.t = s.t + add; s.f = f end
  end
  s.ts = now
end

-- The bucket as stored, carried over to the caller's limits (see the header) when they changed.
local function tb_load(key, cap, rate, period, now)
  local v = redis.call('HMGET', key, 't', 'ts', 'f', 'c', 'r', 'p')
  local t, ts, f = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  if t == nil or ts == nil or f == nil then
    return { t = cap * MICRO, ts = now, f = 0, exists = false }
  end
  local c, r, p = tonumber(v[4]), tonumber(v[5]), tonumber(v[6])
  -- kept: the hash already records these limits, so a write need not set them again.
  local s = { t = t, ts = ts, f = f, exists = true, kept = c == cap and r == rate and p == period }
  if c ~= nil and r ~= nil and p ~= nil and (c ~= cap or r ~= rate or p ~= period) then
    tb_refill(s, c, r, p, now)
    if c ~= cap then
      if s.t >= 0 then
        s.t = muldivmod(s.t, cap, 0, c)
      else
        -- A debt is scaled like tokens, rounded down too (it grows): -ceil(-t * cap / c).
        local q, r = muldivmod(-s.t, cap, 0, c)
        if r > 0 then q = q + 1 end
        s.t = -q
      end
    end
    if s.t > cap * MICRO then s.t = cap * MICRO end
    if s.t < MAX_DEBT_M then s.t = MAX_DEBT_M end
    s.f = 0
  end
  return s
end

-- Milliseconds until the bucket is full again.
local function tb_reset_ms(s, cap, rate, period)
  local missing = cap * MICRO - s.t
  if missing <= 0 then return 0 end
  return ceil_ms(missing, period, rate * MICRO)
end

-- Whole tokens held: 0 while the bucket owes (the retry time then counts the whole deficit).
local function tb_whole(s)
  if s.t <= 0 then return 0 end
  return (muldivmod(s.t, 1, 0, MICRO))
end

-- Charges the (refilled) state when it can pay `cost`: granted = min(lease, whole tokens held),
-- at least cost; or, shaped, when its tokens are there within max_delay ms: granted = cost, and
-- delay = the wait (see the header). Returns allowed, remaining, reset, retry, granted, delay.
local function tb_take(s, cap, rate, period, cost, lease, max_delay)
  local cost_m = cost * MICRO
  local now = cost <= cap and s.t >= cost_m
  -- The whole deficit, a debt included; 0 when it can pay now.
  local wait = 0
  if not now and cost <= cap then wait = ceil_ms(cost_m - s.t, period, rate * MICRO) end
  local retry, granted, delay = 0, 0, 0
  if now then
    granted = cost
    if lease > cost then
      local whole = muldivmod(s.t, 1, 0, MICRO)
      granted = math.max(cost, math.min(lease, whole))
    end
  elseif cost > cap then
    retry = period -- can never be paid; a full period is the honest "not soon"
  elseif wait <= (max_delay or 0) then
    granted, delay = cost, wait
  else
    retry = wait
  end
  if granted > 0 then
    s.t = s.t - granted * MICRO
    s.dirty = true
  end
  return granted > 0, tb_whole(s), tb_reset_ms(s, cap, rate, period), retry, granted, delay
end

local function tb_store(key, s, cap, rate, period)
  if s.kept then
    redis.call('HSET', key, 't', fmt(s.t), 'ts', fmt(s.ts), 'f', fmt(s.f))
  else
    redis.call('HSET', key, 't', fmt(s.t), 'ts', fmt(s.ts), 'f', fmt(s.f), 'c', fmt(cap),
      'r', fmt(rate), 'p', fmt(period))
  end
  redis.call('PEXPIRE', key, fmt(tb_reset_ms(s, cap, rate, period) + TTL_MARGIN_MS))
end

-- Gives `cost` back after a charge that must be undone (Redis Cluster, another slot denied), a
-- lease's unspent tokens, or a shaped grant whose caller left while held (then t may be below
-- zero: the refund lowers what is owed). A missing hash is already full: nothing to give back.
local function tb_refund(key, cap, rate, period, cost, now)
  local s = tb_load(key, cap, rate, period, now)
  if not s.exists then return 0 end
  tb_refill(s, cap, rate, period, now)
  s.t = math.min(cap * MICRO, s.t + cost * MICRO)
  tb_store(key, s, cap, rate, period)
  return 1
end

-- Settles a reservation (settle.lua): refilled up to now, then used < estimate gives back the
-- difference (capped at capacity; an expired bucket is full already and takes none), used >
-- estimate charges it in full, however deep the bucket owes already (down to MAX_DEBT_M only):
-- the debt, which takes exactly as long to refill as the following takes are told to wait
-- (tb_take counts the whole deficit). Returns remaining, debt (whole tokens, the debt rounded up).
local function tb_settle(key, cap, rate, period, now, estimate, used, window, apply)
  local s = tb_load(key, cap, rate, period, now)
  tb_refill(s, cap, rate, period, now)
  if apply then
    local cap_m = cap * MICRO
    if used < estimate and s.exists then
      s.t = math.min(cap_m, s.t + (estimate - used) * MICRO)
      tb_store(key, s, cap, rate, period)
    elseif used > estimate then
      s.t = math.max(MAX_DEBT_M, s.t - (used - estimate) * MICRO)
      tb_store(key, s, cap, rate, period)
    end
  end
  local debt = 0
  if s.t < 0 then
    local q, r = muldivmod(-s.t, 1, 0, MICRO)
    if r > 0 then q = q + 1 end
    debt = q
  end
  return tb_whole(s), debt
end

ALGORITHMS[0] = {
  load = function(key, cap, rate, period, now)
    local s = tb_load(key, cap, rate, period, now)
    tb_refill(s, cap, rate, period, now)
    return s
  end,
  take = tb_take,
  mark = function(s) return 0 end,
  store = tb_store,
  refund = function(key, cap, rate, period, amount, mark, now)
    return tb_refund(key, cap, rate, period, amount, now)
  end,
  settle = tb_settle,
}
