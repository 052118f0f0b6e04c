-- claim_parked: take the parked-task records that are due, each by one sweep only.
--   KEYS[1] due      ZSET  (see park.lua)
--   KEYS[2] records  HASH
--   KEYS[3] old due, KEYS[4] old copies, KEYS[5] old waiters: the records of an earlier release
--           (parked_records.OldParkedRecord: a record named by its JSON, [deadlines key, runs
--           key, waiter, run, name], "<deadlines key>\n<waiter>" -> that name), taken too
--   ARGV[1] most     records to take at once, of each kind
-- Returns {entry, record, entry, record, ...} ("" for a record that is gone) and {name, copy,
-- ...} of the earlier release's, the records removed: the caller sends the copy of each whose
-- wait no copy asked for (a lapsed place, no run granted), and keeps it again as this release
-- records it if its wait has yet to lapse.

local now, most = now_ms(), tonumber(ARGV[1])
local claimed = {{}, {}}
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, most)
if #due > 0 then
  for _, entry in ipairs(due) do
    claimed[1][#claimed[1] + 1] = entry
    claimed[1][#claimed[1] + 1] = redis.call('HGET', KEYS[2], entry) or ''
  end
  redis.call('ZREM', KEYS[1], unpack(due))
  redis.call('HDEL', KEYS[2], unpack(due))
end
local old = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, most)
if #old > 0 then
  for _, record in ipairs(old) do
    claimed[2][#claimed[2] + 1] = record
    claimed[2][#claimed[2] + 1] = redis.call('HGET', KEYS[4], record) or ''
    local ok, fields = pcall(cjson.decode, record)
    local by_waiter = ok and type(fields) == 'table' and fields[1] and fields[3]
      and (fields[1] .. RECORD_SEPARATOR .. fields[3])
    if by_waiter and redis.call('HGET', KEYS[5], by_waiter) == record then
      redis.call('HDEL', KEYS[5], by_waiter)
    end
  end
  redis.call('ZREM', KEYS[3], unpack(old))
  redis.call('HDEL', KEYS[4], unpack(old))
end
return claimed
