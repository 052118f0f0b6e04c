-- claim_parked_waiter: take the parked-task records of waiters of one line, now, whatever their
-- due time: they were offered a slot and their wake copies are to be sent (by the process that
-- made the offer, or the parked task's own, _parking.wake_offered). One taker each: a record
-- taken is marked so (TAKEN_RECORD_MARK) until a sweep or a new park of its wait. A record is
-- leased, not dropped: due again after the lease, its copy marked as woken, so that a sweep
-- sends the copy again should the one sent now be lost in flight before its run is granted.
--   KEYS[1] due      ZSET  (see park.lua)
--   KEYS[2] records  HASH
--   KEYS[3] old due, KEYS[4] old copies, KEYS[5] old waiters: an earlier release's records
--           (see claim_parked.lua), looked in for a waiter this release has no record of
--   KEYS[6] holders, KEYS[7] waiter_info, KEYS[8] present, KEYS[9] gate: the line's own keys
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
--   ARGV[3..] waiters; with KEYS[6..9]: ARGV[3] how many to wake ahead, ARGV[4] the limit
-- Returns {entry, record, entry, record, ...} of the records taken, each record's copy as it
-- was kept before it was woken, and {name, copy, ...} of the earlier release's (none for a
-- waiter with no record: not a parked task, or somebody took it first).

local base, lease_ms = ARGV[1], tonumber(ARGV[2])
local now = now_ms()

-- the line as its records name it (parked_records.record_line): the semaphore's name where the
-- base is "<prefix>:{<name>}" (the prefix is the records key's, "<prefix>:{parked-tasks}:..."),
-- unless that name starts with "<prefix>:{" too; else the base
local head = string.sub(KEYS[2], 1, -#'{parked-tasks}:records' - 1) .. '{'
local line = base
if #base > #head and string.sub(base, 1, #head) == head and string.sub(base, -1) == '}' then
  local name = string.sub(base, #head + 1, -2)
  if string.sub(name, 1, #head) ~= head then
    line = name
  end
end

-- a record not taken yet, split: its header and its copy as kept; nil for one taken or none,
-- and then whether one is kept at all
local function takeable(entry)
  local record = redis.call('HGET', KEYS[2], entry)
  if not record then
    return nil, nil, false
  end
  local cut = string.find(record, RECORD_SEPARATOR, 1, true)
  if not cut or string.sub(record, 1, #TAKEN_RECORD_MARK) == TAKEN_RECORD_MARK then
    return nil, nil, true
  end
  return string.sub(record, 1, cut - 1), string.sub(record, cut + 1), true
end

local waiters = {}
local function add_if_parked(waiter)
  local info = redis.call('HGET', KEYS[7], WAITER_FIELD .. waiter)
  if info and string.match(info, '^%d*|(.?)') == PARKED_MARK then
    waiters[#waiters + 1] = waiter
  end
end
if KEYS[6] then
  local offers = redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', string.format('(%.0f', -now))
  for _, member in ipairs(offers) do
    add_if_parked(string.sub(member, #OFFER_MARK + 1))
  end
  local ahead, limit = tonumber(ARGV[3]), tonumber(ARGV[4])
  local hold = ahead > 0 and tonumber(redis.call('HGET', KEYS[7], HOLD_FIELD))
  if hold and redis.call('EXISTS', KEYS[9]) == 0 then
    for turn, waiter in ipairs(redis.call('ZRANGE', KEYS[8], 0, ahead - 1)) do
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
  local record = redis.call('HGET', KEYS[5], old_entry)
  if not record then
    return
  end
  redis.call('HDEL', KEYS[5], old_entry)
  local copy = redis.call('HGET', KEYS[4], record)
  if not redis.call('ZSCORE', KEYS[3], record) or not copy then
    redis.call('ZREM', KEYS[3], record)
    redis.call('HDEL', KEYS[4], record)
    return
  end
  redis.call('ZADD', KEYS[3], now + lease_ms, record)
  if string.sub(copy, 1, #WOKEN_COPY_MARK) == WOKEN_COPY_MARK then
    copy = string.sub(copy, #WOKEN_COPY_MARK + 1)
  else
    redis.call('HSET', KEYS[4], record, WOKEN_COPY_MARK .. copy)
  end
  old_claimed[#old_claimed + 1] = record
  old_claimed[#old_claimed + 1] = copy
end
for _, waiter in ipairs(waiters) do
  local entry = line .. RECORD_SEPARATOR .. waiter
  local header, copy, kept = takeable(entry)
  if header then
    if not redis.call('ZSCORE', KEYS[1], entry) then
      redis.call('HDEL', KEYS[2], entry)
    else
      redis.call('ZADD', KEYS[1], now + lease_ms, entry)
      if string.sub(copy, 1, #WOKEN_COPY_MARK) == WOKEN_COPY_MARK then
        copy = string.sub(copy, #WOKEN_COPY_MARK + 1)
      end
      redis.call('HSET', KEYS[2], entry, TAKEN_RECORD_MARK .. header .. RECORD_SEPARATOR .. WOKEN_COPY_MARK .. copy)
      claimed[#claimed + 1] = entry
      claimed[#claimed + 1] = header .. RECORD_SEPARATOR .. copy
    end
  elseif not kept then
    claim_old(waiter)
  end
end
if #claimed > 0 then
  extend_exactly(KEYS[1], lease_ms + SWEEP_GRACE_MS)
  extend_exactly(KEYS[2], lease_ms + SWEEP_GRACE_MS)
end
if #old_claimed > 0 then
  extend_exactly(KEYS[3], lease_ms + SWEEP_GRACE_MS)
  extend_exactly(KEYS[4], lease_ms + SWEEP_GRACE_MS)
end
return {claimed, old_claimed}
