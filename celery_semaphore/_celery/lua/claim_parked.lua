-- claim_parked: take the parked-task records that are due, each by one sweep only.
--   KEYS[1] due     ZSET  (see park.lua)
--   KEYS[2] copies  HASH
--   KEYS[3] waiters HASH
--   ARGV[1] most    records to take at once
-- Returns record, copy, record, copy, ... ("" for a copy that is gone), the records removed:
-- the caller sends each copy whose wait no copy asked for (a lapsed place, no run granted).

local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms(), 'LIMIT', 0, tonumber(ARGV[1]))
if #due == 0 then
  return due
end
local claimed = {}
for _, record in ipairs(due) do
  claimed[#claimed + 1] = record
  claimed[#claimed + 1] = redis.call('HGET', KEYS[2], record) or ''
  local ok, fields = pcall(cjson.decode, record)
  local by_waiter = ok and type(fields) == 'table' and fields[1] and fields[3]
    and (fields[1] .. RECORD_SEPARATOR .. fields[3])
  if by_waiter and redis.call('HGET', KEYS[3], by_waiter) == record then
    redis.call('HDEL', KEYS[3], by_waiter)
  end
end
redis.call('ZREM', KEYS[1], unpack(due))
redis.call('HDEL', KEYS[2], unpack(due))
return claimed
