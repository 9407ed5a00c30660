-- take_one: the decision of one take, shared by take.lua (one take per call) and take_batch.lua
-- (many). Preceded by prelude.lua and every algorithm's file (see those headers for the state);
-- it calls each bucket's algorithm through ALGORITHMS (prelude.lua) and knows none of them.
--
-- take_one(k, a, n, now) decides the n buckets KEYS[k+1 .. k+n], whose 7 integers each start at
-- ARGV[a+1] (algorithm code, capacity, rate, period_ms, cost, lease, max_delay_ms),
-- at the clock reading `now` (µs), and appends to `out`:
--   1 when every bucket could pay (now, or shaped within its max_delay_ms) and all were charged,
--   0 when none was charged;
--   then 7 per bucket: allowed (0/1), remaining, reset_ms, retry_after_ms, granted, delay_ms, mark
--   (granted = tokens charged, meaningful only when the take was charged; delay_ms = how long a
--   shaped grant waits for its tokens, 0 if none; mark = what a refund of the charge needs: the
--   window index charged, 0 for a token bucket).
--
-- Two phases: decide every bucket on scratch copies (a key named twice is charged twice, in
-- order, with the limits it was first named with in this take), then write only if all could
-- pay. A denied take writes nothing. A take decided after
-- another in the same call reads what that one wrote.
--
-- `batch` (take_batch.lua's; nil for take.lua): the states the call's earlier takes left, by key.
-- A take then starts from the state there (a copy: it is charged only if the whole take can pay)
-- instead of reading Redis again, and leaves its charged states there instead of writing them;
-- flush_batch writes each once when the call ends. So a batch of takes of one hot bucket reads
-- and writes it once, not once per take. A key named with other limits than the state there was
-- left with is written first and read again (its state carried over to the new limits, as
-- across calls).

local function copied(c)
  local s = {}
  for f, v in pairs(c) do s[f] = v end
  return s
end

local function take_one(k, a, n, now, out, batch)
  local scratch = {}
  local head = #out + 1
  out[head] = 1
  local all = true
  for i = 1, n do
    local key = KEYS[k + i]
    local b = a + 7 * (i - 1)
    local alg = ALGORITHMS[tonumber(ARGV[b + 1])]
    local cap, rate, period, cost, lease = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]),
      tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5]), tonumber(ARGV[b + 6])
    local max_delay = tonumber(ARGV[b + 7])
    local s = scratch[key]
    if s == nil then
      local c = batch and batch[key]
      if c ~= nil and c.alg == alg and c.cap == cap and c.rate == rate and c.period == period then
        s = copied(c)
      else
        if c ~= nil then
          if c.dirty then c.alg.store(key, c, c.cap, c.rate, c.period) end
          batch[key] = nil
        end
        s = alg.load(key, cap, rate, period, now)
        s.alg, s.cap, s.rate, s.period = alg, cap, rate, period
      end
      scratch[key] = s
    end
    local allowed, remaining, reset, retry, granted, delay =
      s.alg.take(s, cap, rate, period, cost, lease, max_delay)
    if not allowed then all = false end
    out[#out + 1] = allowed and 1 or 0
    out[#out + 1] = remaining
    out[#out + 1] = reset
    out[#out + 1] = retry
    out[#out + 1] = granted
    out[#out + 1] = delay or 0
    out[#out + 1] = s.alg.mark(s)
  end

  if all then
    for skey, s in pairs(scratch) do
      if batch then
        batch[skey] = s
      elseif s.dirty then
        s.alg.store(skey, s, s.cap, s.rate, s.period)
      end
    end
  else
    out[head] = 0
  end
  return out
end

-- Writes what the takes of a call left in `batch` (take_one's), each charged state once.
local function flush_batch(batch)
  for key, s in pairs(batch) do
    if s.dirty then s.alg.store(key, s, s.cap, s.rate, s.period) end
  end
end

-- The reply of a take call: the integers of `out` as one string of 8-byte little-endian signed
-- integers (Redis's `struct` library). Redis answers a string as one bulk string, which the
-- service's Redis client reads as one value; an array of integers costs it a parse per element,
-- and writing each integer as decimal text costs Redis a sprintf (BENCHMARKS.md, "The service
-- and Redis per take below 8ee304b's"). At most PACK_AT_ONCE integers are packed by one call
-- (unpack() puts them all on Lua's stack); their formats are built once per length.
local PACK_AT_ONCE = 96
local PACK_FORMATS = {}
local function pack(out, i, j)
  local n = j - i + 1
  local f = PACK_FORMATS[n]
  if f == nil then
    f = '<' .. string.rep('i8', n)
    PACK_FORMATS[n] = f
  end
  return struct.pack(f, unpack(out, i, j))
end

local function packed(out)
  local n = #out
  if n <= PACK_AT_ONCE then return pack(out, 1, n) end
  local parts = {}
  for i = 1, n, PACK_AT_ONCE do
    parts[#parts + 1] = pack(out, i, math.min(i + PACK_AT_ONCE - 1, n))
  end
  return table.concat(parts)
end
