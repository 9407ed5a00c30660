-- instances: record the proxy instances a service replica heard from lately and count the live
-- ones of the deployment. Run by each replica about once a second, off the take path.
--
-- KEYS:  [1] the deployment's sorted set, `<prefix>instances:{instances}` (one key: any slot of a
--        Redis Cluster, no cross-slot access).
-- ARGV:  [1] ttl_ms: an instance not heard from for this long is no longer live;
--        [2..] instance ids heard since the last call (may be none: then this only counts).
-- State: ZADD id -> Redis TIME (ms) of the call that reported it; members older than ttl_ms are
--        removed here; PEXPIRE 2 x ttl_ms on every call, so a deployment that stops calling
--        leaves nothing behind.
-- Reply: the number of live instances (ZCARD after the removal), an integer.
-- Clock: Redis TIME, never a replica's clock (replicas with skewed clocks agree on who is live).

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], now, ARGV[i])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now - ttl))
redis.call('PEXPIRE', KEYS[1], string.format('%.0f', 2 * ttl))
return { redis.call('ZCARD', KEYS[1]) }
