-- claim_parked: take the parked-task records that are due, each by one sweep only.
--   KEYS[1] buckets  ZSET  bucket -> no later than the first due time in it (see park.lua): a
--                          bucket's records are KEYS[3] with ":<bucket>" after it, each value
--                          starting with its due time, looked in only when the index says the
--                          bucket is due (about 100 records at 100,000 parked tasks)
--                          "...:record-leases" beside it (named from it, the same hash tag):
--                          entry -> when the lease of a record a wake-up took ends
--                          (claim_parked_waiter.lua), read first: a drain of 100 tasks a
--                          second leases 100 records a second, and a sorted set of those few
--                          finds them without reading a bucket each (about 10 ms of Redis for
--                          100 buckets of 100 records, measured)
--   KEYS[2] due      ZSET  the due times of an earlier release's records (one, never split)
--   KEYS[3] records  HASH  its records, taken too
--   KEYS[4] old due, KEYS[5] old copies, KEYS[6] old waiters: the records of a release before it
--           (parked_records.OldParkedRecord: a record named by its JSON, [deadlines key, runs
--           key, waiter, run, name], "<deadlines key>\n<waiter>" -> that name), taken too
--   ARGV[1] most     records to take at once, of each kind
-- Returns {entry, record, entry, record, ...} ("" for a record that is gone; each record as
-- kept, its due time off) and {name, copy, ...} of the earlier release's, the records removed:
-- the caller sends the copy of each whose wait no copy asked for (a lapsed place, no run
-- granted), and keeps it again as this release records it if its wait has yet to lapse.

local now, most = now_ms(), tonumber(ARGV[1])
local claimed = {{}, {}}
-- up to "left" records now due of one sorted set of due times and its hash of records
local function take(due_key, records_key, left)
  local due = redis.call('ZRANGEBYSCORE', due_key, '-inf', now, 'LIMIT', 0, left)
  if #due > 0 then
    for _, entry in ipairs(due) do
      claimed[1][#claimed[1] + 1] = entry
      claimed[1][#claimed[1] + 1] = redis.call('HGET', records_key, entry) or ''
    end
    redis.call('ZREM', due_key, unpack(due))
    redis.call('HDEL', records_key, unpack(due))
  end
  return #due
end
local RECORD_BUCKETS = 1024  -- parked_records.RECORD_BUCKETS
local leases_key = string.sub(KEYS[1], 1, -#'record-buckets' - 1) .. 'record-leases'
local left = most
local leased = redis.call('ZRANGEBYSCORE', leases_key, '-inf', now, 'LIMIT', 0, most)
if #leased > 0 then
  for _, entry in ipairs(leased) do
    local bucket = tonumber(string.sub(redis.sha1hex(entry), 1, 8), 16) % RECORD_BUCKETS
    local records_key = KEYS[3] .. ':' .. bucket
    local record = redis.call('HGET', records_key, entry)
    if record then
      claimed[1][#claimed[1] + 1] = entry
      claimed[1][#claimed[1] + 1] = string.gsub(record, '^%d*', '', 1)
      redis.call('HDEL', records_key, entry)
      left = left - 1
    end
  end
  redis.call('ZREM', leases_key, unpack(leased))
end
for _, bucket in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, most)) do
  if left == 0 then
    break
  end
  local records_key = KEYS[3] .. ':' .. bucket
  local kept, taken, first = redis.call('HGETALL', records_key), {}, nil
  for i = 1, #kept, 2 do
    local due = tonumber(string.match(kept[i + 1], '^%d+')) or 0  -- none: unreadable, due now
    if due <= now and left > 0 then
      taken[#taken + 1] = kept[i]
      claimed[1][#claimed[1] + 1] = kept[i]
      claimed[1][#claimed[1] + 1] = string.gsub(kept[i + 1], '^%d*', '', 1)
      left = left - 1
    elseif not first or due < first then
      first = due
    end
  end
  if #taken > 0 then
    redis.call('HDEL', records_key, unpack(taken))
    redis.call('ZREM', leases_key, unpack(taken))
  end
  -- the bucket's index entry is its first due time again (its records expired with it: gone)
  if first then
    redis.call('ZADD', KEYS[1], string.format('%.0f', first), bucket)
  else
    redis.call('ZREM', KEYS[1], bucket)
  end
end
take(KEYS[2], KEYS[3], most)
local old = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, most)
if #old > 0 then
  for _, record in ipairs(old) do
    claimed[2][#claimed[2] + 1] = record
    claimed[2][#claimed[2] + 1] = redis.call('HGET', KEYS[5], record) or ''
    local ok, fields = pcall(cjson.decode, record)
    local by_waiter = ok and type(fields) == 'table' and fields[1] and fields[3]
      and (fields[1] .. RECORD_SEPARATOR .. fields[3])
    if by_waiter and redis.call('HGET', KEYS[6], by_waiter) == record then
      redis.call('HDEL', KEYS[6], by_waiter)
    end
  end
  redis.call('ZREM', KEYS[4], unpack(old))
  redis.call('HDEL', KEYS[5], unpack(old))
end
return claimed
