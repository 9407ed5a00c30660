-- acquire: take one concurrency slot of every key, or of none.
--
-- KEYS[1..n]  the keys' slot sets (sorted sets: member = slot id, score = deadline in ms on the
--             Redis clock). On a Cluster every key of one call is in one hash slot (the caller
--             groups them; the {hash tag} of each key is its caller key). A set also holds the
--             names released before their acquire arrived (release.lua): member '~' .. id, score
--             minus the time they are remembered until; they are never counted as slots.
-- ARGV[1]     the slot id (opaque text): the caller's, when it names its slots, else the service's.
--             An acquire under an id already held in a set is that slot again: it does not count
--             against itself, and its deadline moves (idempotent under a caller's retry).
-- ARGV[2]     the slot's deadline from now, in ms (1..=86400000)
-- ARGV[2+i]   the limit of KEYS[i] (1..=1e9)
-- Clock       Redis TIME, read once: no caller's clock matters.
--             An acquire under a name released already (its caller gave up on it) takes nothing.
-- Reply       {allowed (0/1), then per key: allowed (0/1), in_flight, retry_after_ms}
--             in_flight counts the live slots after this call (this one included when taken);
--             retry_after_ms is 0 when allowed, else min(1000, ms until the oldest slot's deadline).
-- Writes      only when every key had room: ZADD of the id at now + ttl, then PEXPIRE so the set
--             outlives its newest slot and no longer (a set is never left without a TTL). A call
--             that denies removes expired members only.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id = ARGV[1]
local ttl = tonumber(ARGV[2])
local out = {1}
local counts = {}
for i, key in ipairs(KEYS) do
  -- Expired slots (scores in (0, now]) and expired released names (scores in [-now, 0)).
  redis.call('ZREMRANGEBYSCORE', key, -now, now)
  local n = redis.call('ZCOUNT', key, '(0', '+inf')
  if redis.call('ZSCORE', key, id) then n = n - 1 end
  local limit = tonumber(ARGV[2 + i])
  counts[i] = n
  if n < limit and not redis.call('ZSCORE', key, '~' .. id) then
    out[#out + 1] = 1
    out[#out + 1] = n + 1
    out[#out + 1] = 0
  else
    out[1] = 0
    local retry = 1000
    local oldest = redis.call('ZRANGEBYSCORE', key, '(0', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if oldest[2] then
      local left = tonumber(oldest[2]) - now
      if left < 1 then left = 1 end
      if left < retry then retry = left end
    end
    out[#out + 1] = 0
    out[#out + 1] = n
    out[#out + 1] = retry
  end
end
if out[1] == 1 then
  for _, key in ipairs(KEYS) do
    redis.call('ZADD', key, now + ttl, id)
    if redis.call('PTTL', key) < ttl then
      redis.call('PEXPIRE', key, ttl)
    end
  end
else
  -- Nothing taken: in_flight reports the sets as they stand.
  for i = 1, #KEYS do
    if out[3 * i - 1] == 1 then out[3 * i] = counts[i] end
  end
end
return out
