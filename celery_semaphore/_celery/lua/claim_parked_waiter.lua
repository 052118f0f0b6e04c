-- claim_parked_waiter: take the parked-task records of waiters of one line, now, whatever their
-- due time: they were offered a slot and their wake copies are to be sent (by the process that
-- made the offer, or the parked task's own, _parking.wake_offered). One taker each. A record is
-- leased, not dropped: due again after the lease, its copy marked as woken, so that a sweep
-- sends the copy again should the one sent now be lost in flight before its run is granted.
--   KEYS[1] due     ZSET  (see park.lua)
--   KEYS[2] copies  HASH
--   KEYS[3] waiters HASH
--   KEYS[4] holders, KEYS[5] waiter_info, KEYS[6] present, KEYS[7] gate: the line's own keys
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
--   ARGV[1] the line's deadlines key
--   ARGV[2] lease_ms
--   ARGV[3..] waiters; with KEYS[4..7]: ARGV[3] how many to wake ahead, ARGV[4] the limit
-- Returns record, copy, record, copy, ... of the records taken (none for a waiter with no
-- record: not a parked task, or somebody took it first).

local lease_ms = tonumber(ARGV[2])
local now = now_ms()
local waiters = {}
local function add_if_parked(waiter)
  local info = redis.call('HGET', KEYS[5], WAITER_FIELD .. waiter)
  if info and string.match(info, '^%d*|(.?)') == PARKED_MARK then
    waiters[#waiters + 1] = waiter
  end
end
if KEYS[5] then
  local offers = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', string.format('(%.0f', -now))
  for _, member in ipairs(offers) do
    add_if_parked(string.sub(member, #OFFER_MARK + 1))
  end
  local ahead, limit = tonumber(ARGV[3]), tonumber(ARGV[4])
  local hold = ahead > 0 and tonumber(redis.call('HGET', KEYS[5], HOLD_FIELD))
  if hold and redis.call('EXISTS', KEYS[7]) == 0 then
    for turn, waiter in ipairs(redis.call('ZRANGE', KEYS[6], 0, ahead - 1)) do
      local record = redis.call('HGET', KEYS[3], ARGV[1] .. RECORD_SEPARATOR .. waiter)
      local within = record and tonumber(string.match(redis.call('HGET', KEYS[2], record) or '', '^ahead:(%d+)\n'))
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

local claimed = {}
for _, waiter in ipairs(waiters) do
  local entry = ARGV[1] .. RECORD_SEPARATOR .. waiter
  local record = redis.call('HGET', KEYS[3], entry)
  if record then
    redis.call('HDEL', KEYS[3], entry)
    local copy = redis.call('HGET', KEYS[2], record)
    if not redis.call('ZSCORE', KEYS[1], record) or not copy then
      redis.call('ZREM', KEYS[1], record)
      redis.call('HDEL', KEYS[2], record)
    else
      redis.call('ZADD', KEYS[1], now + lease_ms, record)
      if string.sub(copy, 1, #WOKEN_COPY_MARK) == WOKEN_COPY_MARK then
        copy = string.sub(copy, #WOKEN_COPY_MARK + 1)
      else
        redis.call('HSET', KEYS[2], record, WOKEN_COPY_MARK .. copy)
      end
      claimed[#claimed + 1] = record
      claimed[#claimed + 1] = copy
    end
  end
end
if #claimed > 0 then
  extend_exactly(KEYS[1], lease_ms + SWEEP_GRACE_MS)
  extend_exactly(KEYS[2], lease_ms + SWEEP_GRACE_MS)
end
return claimed
