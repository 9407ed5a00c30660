-- reset: delete one bucket's hash, or one concurrency key's slot set (POST /v1/buckets/reset).
-- The next take finds a new bucket (full), the next acquire no slot held.
--
-- KEYS:  one key: `<prefix><alg>:{<key>}` or `<prefix>cc:{<key>}`. Every key of a bucket is this
--        one (the limits are fields of the hash, not keys), so one DEL in its own hash slot
--        removes all of it, on a Cluster too. Settlement ids (`settle.lua`) are kept: an id
--        applied before the reset is still applied once.
-- ARGV:  none.
-- Reply: {1 when the key existed, else 0}.
-- Clock: not read.

return { redis.call('DEL', KEYS[1]) }
