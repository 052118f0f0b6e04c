-- acquire: one try for a slot, fair by ticket order, with hand-off of free slots.
--   KEYS    the semaphore keys (see _lib.lua)
--   ARGV[1] token        the holder token this try would hold the slot under
--   ARGV[2] waiter       the waiter id that keeps its place in line across tries (a task id)
--   ARGV[3] settings     "<limit>|<lease_ms>|<patience_ms>|<enqueue><fresh>|<label>", packed in one
--                        argument because a client pays for every argument it sends (redis-py
--                        encodes each one in Python), and these rarely change between calls:
--     limit        the limit to apply when no runtime override is stored
--     lease_ms     lease length for a granted slot
--     patience_ms  how long a refused waiter keeps its place without asking again
--     enqueue      "1": a new waiter takes a ticket; "0": a one-shot try that never queues and
--                  is granted only if it passes no present waiter
--     fresh        "1": the caller knows this waiter never asked before, so when nobody is
--                  present and a slot is free the grant skips the line entirely (the
--                  uncontended fast path: no purge, no queue keys touched)
--     label        free text shown by status for this holder (host, pid, task id); the rest
--                  of the argument, so it may contain "|"
--   ARGV[4] ticket       "" for a new waiter; or the ticket it was given before, so a waiter
--                        that left the line (a Celery countdown, a lapsed offer) comes back to
--                        its old place
--   ARGV[5] wake         the waiter's wake address (a channel) or "": where an offer is told
--   ARGV[6] run          "" or the run id of this copy of a wait: if another copy of the run was
--                        granted within the last ARGV[7] ms and still holds its slot, or
--                        released it normally, this try is answered RUNNING or RAN
--   ARGV[7] remember_ms  how long a granted run is remembered (counted from its grant)
--   ARGV[4..7] may be left out when empty (read as ""); KEYS[9..10] are passed only with a run
-- Tickets are server time (ms) * 1024 plus a counter (mod 1024) for ties: ordered by first ask,
-- and still ordered after the counter key expired. A float holds them exactly (below 2^53).
-- Returns (the codes are named in _lib.lua), when granted, the bare integer outcome (GRANTED or
-- CLAIMED: the common answer stays short to parse); for a duplicate run, {RUNNING, lease_ms} (its
-- other copy holds the slot now, its lease lasting lease_ms more unless renewed) or RAN (the run
-- finished); when refused, {WAIT, position, free, limit, hold, ticket, turn, unheard...}:
--   outcome  GRANTED: the slot is held under token (also when token already held it, so a
--            resend by redis-py after a connection error is harmless); CLAIMED: granted by
--            claiming the offer a release made to this waiter; WAIT: refused
--   position the waiter's 0-based place in line, away waiters included (0 when granted)
--   free     free slots after this call (offers count as taken)
--   limit    the limit in force (override or the settings' limit)
--   hold     moving average of recent hold times in ms, or -1 while none is known (or granted)
--   ticket   the waiter's ticket as a decimal string ("" when granted or not queued)
--   turn     the waiter's 0-based place among present waiters: slots are offered by this
--   unheard  the waiters this try offered a slot to whose wake-up nobody heard (see notify)

local token, waiter = ARGV[1], ARGV[2]
local default_limit, lease_ms, patience_ms, enqueue, fresh, label =
  string.match(ARGV[3], '^(%d+)|(%d+)|(%d+)|([01])([01])|(.*)$')
default_limit, lease_ms, patience_ms = tonumber(default_limit), tonumber(lease_ms), tonumber(patience_ms)
enqueue, fresh = enqueue == '1', fresh == '1'
local wake, run, remember_ms = ARGV[5] or '', ARGV[6] or '', tonumber(ARGV[7])

local now = now_ms()

if run ~= '' then
  local taken, lease_left_ms = run_taken(run, token, now)
  if taken == 'running' then
    return {RUNNING, lease_left_ms}
  elseif taken == 'ran' then
    return RAN
  end
end

-- Every grant goes through here: a run remembers the token it got the slot under.
local function granted(code)
  if run ~= '' then
    record_run(run, token, now, remember_ms)
  end
  return code
end

local limit
if fresh then
  -- the fast path: a newcomer, nobody present to pass, a slot free
  limit = current_limit(default_limit)
  local size = redis.call('ZCARD', K_HOLDERS)
  if size < limit and redis.call('ZCARD', K_PRESENT) == 0 then
    hold(token, now, lease_ms, label, size == 0)
    return granted(GRANTED)
  end
end

-- @rest-of-lib

if not fresh and redis.call('ZREM', K_HOLDERS, OFFER_MARK .. waiter) == 1 then
  -- a release offered this waiter a slot: take it (the entry counted already, so nothing
  -- else needs looking at: the woken waiter's one round trip stays short)
  hold(token, now, lease_ms, label, false)
  drop_waiter(waiter)
  return granted(CLAIMED)
end
limit = limit or current_limit(default_limit)
purge(now)
if redis.call('ZSCORE', K_HOLDERS, token) then
  -- a repeat of a granted try: the entry still counts, so extending it takes no second slot
  redis.call('ZADD', K_HOLDERS, 'GT', now + lease_ms, token)
  extend(K_HOLDERS, lease_ms + GRACE_MS, false)
  return granted(GRANTED)
end

local size = redis.call('ZCARD', K_HOLDERS)
local average = tonumber(redis.call('HGET', K_WAITER_INFO, HOLD_FIELD)) or -1

if not enqueue then
  local left, _, offered = hand_off(now, limit, nil)
  if left > 0 then
    hold(token, now, lease_ms, label, size == 0 and offered == 0)
    return granted(GRANTED)
  end
  return {WAIT, redis.call('ZCARD', K_QUEUE), left, limit, average, '', redis.call('ZCARD', K_PRESENT),
          unpack(unheard)}
end

local ticket = redis.call('ZSCORE', K_QUEUE, waiter)
if ticket then
  ticket = tonumber(ticket)
  if wake ~= '' then
    local info = redis.call('HGET', K_WAITER_INFO, WAITER_FIELD .. waiter) or ''
    local first, address = string.match(info, '^(%d*)|(.*)$')
    if address ~= wake then
      redis.call('HSET', K_WAITER_INFO, WAITER_FIELD .. waiter, (first or now) .. INFO_SEPARATOR .. wake)
    end
  end
else
  ticket = tonumber(ARGV[4])
  if not ticket then
    ticket = new_ticket(now)
  end
  redis.call('ZADD', K_QUEUE, ticket, waiter)
  redis.call('HSET', K_WAITER_INFO, WAITER_FIELD .. waiter, now .. INFO_SEPARATOR .. wake)
end
redis.call('ZADD', K_PRESENT, ticket, waiter)
redis.call('ZADD', K_DEADLINES, now + patience_ms, waiter)

local left, chosen, offered = hand_off(now, limit, waiter)
if chosen then
  drop_waiter(waiter)
  hold(token, now, lease_ms, label, size == 0 and offered == 0)
  return granted(GRANTED)
end
extend_line(patience_ms + GRACE_MS)
return {WAIT, redis.call('ZRANK', K_QUEUE, waiter), left, limit, average, string.format('%.0f', ticket),
        redis.call('ZRANK', K_PRESENT, waiter), unpack(unheard)}
