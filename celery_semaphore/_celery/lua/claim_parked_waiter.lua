-- claim_parked_waiter: take the parked-task records of waiters of one line, now, whatever their
-- due time: they were offered a slot and their wake copies are to be sent (by the process that
-- made the offer, or the parked task's own, _parking.wake_offered). One taker each: a record
-- taken is marked so (TAKEN_RECORD_MARK) until a sweep or a new park of its wait. A record is
-- leased, not dropped: due again after the lease, its copy marked as woken, so that a sweep
-- sends the copy again should the one sent now be lost in flight before its run is granted.
--   KEYS[1] buckets  ZSET  (see park.lua): a record is in the bucket of its entry, the records
--                          key KEYS[3] with ":<bucket>" after it (parked_records.record_bucket:
--                          the first 32 bits of the entry's SHA-1, modulo RECORD_BUCKETS), its
--                          value starting with its due time; a record taken here keeps that due
--                          time and is leased in "...:record-leases" (named from KEYS[1], see
--                          claim_parked.lua): few at a time, swept cheaply
--   KEYS[2] due, KEYS[3] records: an earlier release's, one of each (see claim_parked.lua),
--           looked in for a waiter with no record in its bucket
--   KEYS[4] old due, KEYS[5] old copies, KEYS[6] old waiters: a release before it's records
--           (see claim_parked.lua), looked in for a waiter with no record in either
--   KEYS[7] holders, KEYS[8] waiter_info, KEYS[9] present, KEYS[10] gate: the line's own keys
--           (see _lib.lua), given only on a single Redis (two hash tags), right after a release
--           of the same line in one round trip (_parking.release_follower): then also every
--           waiter holding a live offer of the line whose address is parked, so that the release
--           needs no second round trip; and, woken ahead, the parked waiters among the first
--           ARGV[3] present ones (the next to be offered) whose kept copy is marked "ahead:<ms>\n"
--           (parked_records.AHEAD_COPY_MARK) and whose slot should come within those ms (by the
--           line's average hold and the limit ARGV[4], as policy.stands_by judges it on
--           arrival), while no rate, spacing or pause is stored: they arrive and wait in a pool
--           process for their offer, which then takes a publish, not a trip through the broker
--           (measured: about 9 ms a hand-off)
--   ARGV[1] the line's keys' base (its records are named by its line, see below)
--   ARGV[2] lease_ms
--   ARGV[3..] waiters; with KEYS[7..10]: ARGV[3] how many to wake ahead, ARGV[4] the limit
-- Returns {entry, record, entry, record, ...} of the records taken, each record's copy as it
-- was kept before it was woken, and {name, copy, ...} of the earlier release's (none for a
-- waiter with no record: not a parked task, or somebody took it first).

local RECORD_BUCKETS = 1024  -- parked_records.RECORD_BUCKETS
local base, lease_ms = ARGV[1], tonumber(ARGV[2])
local leases_key = string.sub(KEYS[1], 1, -#'record-buckets' - 1) .. 'record-leases'
local now = now_ms()

-- the line as its records name it (parked_records.record_line): the semaphore's name where the
-- base is "<prefix>:{<name>}" (the prefix is the records key's, "<prefix>:{parked-tasks}:..."),
-- unless that name starts with "<prefix>:{" too; else the base
local head = string.sub(KEYS[3], 1, -#'{parked-tasks}:records' - 1) .. '{'
local line = base
if #base > #head and string.sub(base, 1, #head) == head and string.sub(base, -1) == '}' then
  local name = string.sub(base, #head + 1, -2)
  if string.sub(name, 1, #head) ~= head then
    line = name
  end
end

-- where the record of an entry is kept: its bucket's records, and the bucket
local function bucket_of(entry)
  local bucket = tostring(tonumber(string.sub(redis.sha1hex(entry), 1, 8), 16) % RECORD_BUCKETS)
  return KEYS[3] .. ':' .. bucket, bucket
end

-- a record not taken yet, split: its header and its copy as kept; nil for one taken or none,
-- and then where it is kept (records, bucket: nil for the earlier release's keys, whose due
-- times are KEYS[2]), or nothing when no record is kept at all
local function takeable(entry)
  local records_key, bucket = bucket_of(entry)
  local record = redis.call('HGET', records_key, entry)
  local due = ''
  if record then
    due = string.match(record, '^%d*')
    record = string.sub(record, #due + 1)
  else
    records_key, bucket = KEYS[3], nil
    record = redis.call('HGET', records_key, entry)
    if not record then
      return nil, nil
    end
  end
  local where = {records_key, bucket, due}
  local cut = string.find(record, RECORD_SEPARATOR, 1, true)
  if not cut or string.sub(record, 1, #TAKEN_RECORD_MARK) == TAKEN_RECORD_MARK then
    return nil, nil, where
  end
  return string.sub(record, 1, cut - 1), string.sub(record, cut + 1), where
end

local waiters = {}
local function add_if_parked(waiter)
  local info = redis.call('HGET', KEYS[8], WAITER_FIELD .. waiter)
  if info and string.match(info, '^%d*|(.?)') == PARKED_MARK then
    waiters[#waiters + 1] = waiter
  end
end
if KEYS[7] then
  local offers = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', string.format('(%.0f', -now))
  for _, member in ipairs(offers) do
    add_if_parked(string.sub(member, #OFFER_MARK + 1))
  end
  local ahead, limit = tonumber(ARGV[3]), tonumber(ARGV[4])
  local hold = ahead > 0 and tonumber(redis.call('HGET', KEYS[8], HOLD_FIELD))
  if hold and redis.call('EXISTS', KEYS[10]) == 0 then
    for turn, waiter in ipairs(redis.call('ZRANGE', KEYS[9], 0, ahead - 1)) do
      local _, copy = takeable(line .. RECORD_SEPARATOR .. waiter)
      local within = copy and tonumber(string.match(copy, '^ahead:(%d+)\n'))
      if within and math.ceil(turn / limit) * hold <= within then
        add_if_parked(waiter)
      end
    end
  end
else
  for i = 3, #ARGV do
    waiters[#waiters + 1] = ARGV[i]
  end
end

local claimed, old_claimed = {}, {}
local function claim_old(waiter)
  local old_entry = base .. ':deadlines' .. RECORD_SEPARATOR .. waiter
  local record = redis.call('HGET', KEYS[6], old_entry)
  if not record then
    return
  end
  redis.call('HDEL', KEYS[6], old_entry)
  local copy = redis.call('HGET', KEYS[5], record)
  if not redis.call('ZSCORE', KEYS[4], record) or not copy then
    redis.call('ZREM', KEYS[4], record)
    redis.call('HDEL', KEYS[5], record)
    return
  end
  redis.call('ZADD', KEYS[4], now + lease_ms, record)
  if string.sub(copy, 1, #WOKEN_COPY_MARK) == WOKEN_COPY_MARK then
    copy = string.sub(copy, #WOKEN_COPY_MARK + 1)
  else
    redis.call('HSET', KEYS[5], record, WOKEN_COPY_MARK .. copy)
  end
  old_claimed[#old_claimed + 1] = record
  old_claimed[#old_claimed + 1] = copy
end
for _, waiter in ipairs(waiters) do
  local entry = line .. RECORD_SEPARATOR .. waiter
  local header, copy, where = takeable(entry)
  if header then
    local records_key, bucket, due = where[1], where[2], where[3]
    if not bucket and not redis.call('ZSCORE', KEYS[2], entry) then
      redis.call('HDEL', records_key, entry)
    else
      if string.sub(copy, 1, #WOKEN_COPY_MARK) == WOKEN_COPY_MARK then
        copy = string.sub(copy, #WOKEN_COPY_MARK + 1)
      end
      local taken = TAKEN_RECORD_MARK .. header .. RECORD_SEPARATOR .. WOKEN_COPY_MARK .. copy
      if bucket then
        redis.call('HSET', records_key, entry, due .. taken)
        redis.call('ZADD', leases_key, now + lease_ms, entry)
        extend_exactly(leases_key, lease_ms + SWEEP_GRACE_MS)
      else
        redis.call('ZADD', KEYS[2], now + lease_ms, entry)
        redis.call('HSET', records_key, entry, taken)
        extend_exactly(KEYS[2], lease_ms + SWEEP_GRACE_MS)
      end
      claimed[#claimed + 1] = entry
      claimed[#claimed + 1] = header .. RECORD_SEPARATOR .. copy
      extend_exactly(records_key, lease_ms + SWEEP_GRACE_MS)
    end
  elseif not where then
    claim_old(waiter)
  end
end
if #old_claimed > 0 then
  extend_exactly(KEYS[4], lease_ms + SWEEP_GRACE_MS)
  extend_exactly(KEYS[5], lease_ms + SWEEP_GRACE_MS)
end
return {claimed, old_claimed}
