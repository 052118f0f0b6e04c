-- park: keep a parked Celery task's record in Redis, so that a sweep in any worker process can
-- send its copy again when no copy of its wait asked in time: its backstop copy was lost with the
-- worker that parked it (see _celery/parking.py). One record per waiter of a line, named by the
-- two (a waiter has one place in a line); parking again moves it on. The records are split into
-- buckets by entry (parked_records.record_bucket), each small enough for Redis's compact encoding,
-- and each record carries its own due time: a sorted set of due times beside the records named
-- every entry twice, 70 B of a waiting task's 200 (measured, docs/benchmarks.md).
--   KEYS[1] records  HASH  entry -> "<due ms><header>\n<copy>": when a sweep looks at it (server
--                          ms, digits: a header starts with none), the header (the wait's run,
--                          parked_records.record_header: no raw newline), then the wake copy,
--                          serialized as the task's messages are, or its mark (the copy waits in
--                          the broker). TAKEN_RECORD_MARK between the due time and the header: a
--                          wake-up took it (claim_parked_waiter). The entry's bucket
--   KEYS[2] lines    ZSET  "[<line base>, <limit>]" -> until when it has parked waiters: the
--                          lines a tick looks at (tick.lua), since no script may run on a line
--                          whose waiters are all parked
--   KEYS[3] buckets  ZSET  bucket -> no later than the first due time in it (claim_parked.lua);
--                          "...:record-leases" beside it (named from it, the same hash tag) holds
--                          the leases of records a wake-up took (claim_parked_waiter.lua): a
--                          record parked anew or forgotten leaves it
--   ARGV[1] entry   "<line>\n<waiter>" (parked_records.record_entry: the line by its name)
--   ARGV[2] look_in_ms
--   ARGV[3] value   the record to keep, its due time left out; with "forget", its header alone
--   ARGV[4] mode    "": keep the record, moved on if it exists; "nx": keep it only if none is
--                   kept (a sweep putting back a record it took, due later, never overwrites the
--                   newer record of a task that parked again meanwhile); "forget": drop the record
--                   if it is still that wait's (the wait was given up)
--   ARGV[5] line    "" or the line's member of KEYS[2]
--   ARGV[6] bucket  the entry's bucket (its member of KEYS[3])
--   with "forget": KEYS[4] due and KEYS[5] records of an earlier release (one of each, never
--   split), looked in too; KEYS[6] old due, KEYS[7] old copies, KEYS[8] old waiters (the records
--   of a release before it, see claim_parked.lua), ARGV[7] the name that release gave the wait's
--   record and ARGV[8] its waiter's entry there: forgotten too (a wait it parked that a worker
--   of this release gave up)
-- Returns 1, or 0 when "nx" found a record there. The keys expire once the last record is due
-- (plus a grace), unless swept before.

local entry, value, mode = ARGV[1], ARGV[3], ARGV[4]
local leases_key = string.sub(KEYS[3], 1, -#'record-buckets' - 1) .. 'record-leases'
-- a kept record as a wait's header starts it: its due time and taken mark off
local function as_kept(record)
  record = string.gsub(record, '^%d*', '', 1)
  if string.sub(record, 1, #TAKEN_RECORD_MARK) == TAKEN_RECORD_MARK then
    record = string.sub(record, #TAKEN_RECORD_MARK + 1)
  end
  return record
end
if mode == 'forget' then
  local kept = redis.call('HGET', KEYS[1], entry)
  if kept and string.sub(as_kept(kept), 1, #value + 1) == value .. RECORD_SEPARATOR then
    redis.call('HDEL', KEYS[1], entry)
    redis.call('ZREM', leases_key, entry)
  end
  kept = KEYS[5] and redis.call('HGET', KEYS[5], entry)  -- the earlier release's records
  if kept and string.sub(as_kept(kept), 1, #value + 1) == value .. RECORD_SEPARATOR then
    redis.call('ZREM', KEYS[4], entry)
    redis.call('HDEL', KEYS[5], entry)
  end
  local old_record, old_entry = ARGV[7], ARGV[8]
  if KEYS[8] and old_record then
    redis.call('ZREM', KEYS[6], old_record)
    redis.call('HDEL', KEYS[7], old_record)
    if redis.call('HGET', KEYS[8], old_entry) == old_record then
      redis.call('HDEL', KEYS[8], old_entry)
    end
  end
  return 1
end
local now = now_ms()
local due_at = now + tonumber(ARGV[2])
local ttl_ms = tonumber(ARGV[2]) + SWEEP_GRACE_MS
if mode == 'nx' then
  if redis.call('HSETNX', KEYS[1], entry, string.format('%.0f', due_at) .. value) == 0 then
    return 0
  end
else
  redis.call('HSET', KEYS[1], entry, string.format('%.0f', due_at) .. value)
  redis.call('ZREM', leases_key, entry)  -- parked anew: a copy of the wait asked
end
redis.call('ZADD', KEYS[3], 'LT', due_at, ARGV[6])  -- LT still adds a new member
extend_exactly(KEYS[1], ttl_ms)
extend_exactly(KEYS[3], ttl_ms)
local line = ARGV[5] or ''
if line ~= '' then
  redis.call('ZADD', KEYS[2], 'GT', due_at, line)  -- GT still adds a new member
  extend_exactly(KEYS[2], ttl_ms)
end
return 1
