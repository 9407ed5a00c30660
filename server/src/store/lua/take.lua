-- take: charge every bucket of one request (of one Redis Cluster slot), all or none.
-- Preceded by prelude.lua, every algorithm's file and take_one.lua.
--
-- KEYS:  KEYS[i] = bucket i (every key carries the same {hash tag} slot on a cluster).
-- ARGV:  7 integers per bucket i, at 7*(i-1)+1 ..: algorithm (its code: ALGORITHMS in prelude.lua),
--        capacity, rate, period_ms, cost, lease (= cost when no lease was asked for),
--        max_delay_ms (shaping, token buckets only; 0 = none).
-- Reply: integers (never floats: every value is built integral and below 2^53), as one string
--        of 8-byte little-endian integers (packed() in take_one.lua):
--        [1] = 1 when every bucket could pay and all were charged, 0 when none was charged;
--        then 7 per bucket: allowed (0/1), remaining, reset_ms, retry_after_ms, granted, delay_ms,
--        mark (see take_one.lua).
-- Clock: one Redis TIME read per call, shared by all buckets.

return packed(take_one(0, 0, #KEYS, now_us(), {}))
