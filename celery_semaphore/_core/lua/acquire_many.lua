-- acquire_many: one all-or-nothing try for w slots of each of several semaphores.
--   KEYS    10 per semaphore, semaphore after semaphore (see _lib.lua, use_semaphore); all in
--           one hash slot on a cluster
--   ARGV[1] token        the holder token; a weight w > 1 is written in it ("<random>*<w>"), and
--                        the slots are held as w entries (see slot_members)
--   ARGV[2] waiter       "*<w>*<random>": keeps its place in every line across tries
--   ARGV[3] lease_ms     lease length of the granted slots
--   ARGV[4] patience_ms  how long a refused waiter keeps its places without asking again
--   ARGV[5] enqueue      "1": a new waiter takes a ticket in every line; "2": the same, and the
--                        caller knows it never asked before; "0": a one-shot try, granted only
--                        if it passes nobody present in any line. With "0" or "2", when nobody
--                        is present in any line and every semaphore has room, the grant skips
--                        the lines entirely (no purge, no line keys touched)
--   ARGV[6] label        free text shown by status for this holder
--   ARGV[7] ticket       "" for a new waiter, or the ticket it had before (to come back to it)
--   ARGV[8] wake         the waiter's wake address (a channel), or ""
--   ARGV[9] n            the number of semaphores
--   ARGV[10..9+n]        each semaphore's rules where no runtime override is stored (see
--                        rules_in_force in _lib.lua): a weight w takes w starts of a rate
--   ARGV[10+n] run       "" or the run id of this copy of a wait (see acquire.lua): then
--                        KEYS[10n+1] and KEYS[10n+2] are the run records (runs, run_expiry) of
--                        the first semaphore, and a copy of a run granted or finished within
--                        ARGV[11+n] ms is answered RUNNING or RAN
--   ARGV[11+n] remember_ms
-- One ticket for all lines: every line orders its waiters by (ticket, waiter id), so any two
-- waiters stand in the same order in every line they share, and nobody waits for someone who
-- waits for them (no deadlock). A waiter holds nothing while it waits (no hoarding): it takes
-- its w slots of every semaphore in the one script that finds it at the head of every line
-- (nobody present ahead of it) with w slots free in each. Until then the lines it heads wait
-- for it: strict first-ask order per semaphore, so a heavy waiter is never starved by light ones.
-- Returns (the codes are named in _lib.lua) the bare integer GRANTED when granted (also for a
-- repeat of a granted token), or {GRANTED, to_wake...} when the grant handed slots on to
-- waiters its caller wakes (see notify in _lib.lua); when refused {WAIT, position, free, limit,
-- blocking, ticket, retry_ms, to_wake...}: the most waiters ahead of it in any line, the fewest
-- free slots of any semaphore, that semaphore's limit, the 0-based index of the first semaphore
-- that holds it back, the ticket as a decimal string ("" if not queued), 0 or, when it heads
-- every line with room and only a rate, a spacing or a pause holds it back, the ms until they
-- allow its start (it asks again then; the lines it heads wait for it meanwhile), and the
-- waiters its purges offered a slot whom the caller wakes;
-- {TOO_HEAVY, index, limit} when w is above the limit (or the rate's count) in force of
-- semaphore <index> (0-based): such a try would wait forever, so it is refused and the waiter
-- leaves every line.

local token, waiter = ARGV[1], ARGV[2]
local lease_ms, patience_ms = tonumber(ARGV[3]), tonumber(ARGV[4])
local enqueue, fresh, label, wake = ARGV[5] ~= '0', ARGV[5] ~= '1', ARGV[6], ARGV[8]
local n = tonumber(ARGV[9])
local run, remember_ms = ARGV[10 + n] or '', tonumber(ARGV[11 + n])
local members = slot_members(token)
local weight = #members
local now = now_ms()

if run ~= '' then
  K_RUNS, K_RUN_EXPIRY = KEYS[10 * n + 1], KEYS[10 * n + 2]
  use_semaphore(1)  -- a run's token holds a slot of every semaphore: the first one tells
  local taken = run_taken(run, token, now)
  if taken == 'running' then
    return RUNNING
  elseif taken == 'ran' then
    return RAN
  end
end

-- every grant goes through here: a run remembers the token it got the slots under
local function granted()
  if run ~= '' then
    record_run(run, token, now, remember_ms)
  end
  if #to_wake > 0 then
    return {GRANTED, unpack(to_wake)}
  end
  return GRANTED
end

local function hold_all(i, deadline, was_empty)
  local entries = {}
  for k = 1, weight do
    entries[#entries + 1] = deadline
    entries[#entries + 1] = members[k]
  end
  redis.call('ZADD', K_HOLDERS, unpack(entries))
  extend(K_HOLDERS, lease_ms + GRACE_MS, was_empty)
end

local function hold_everywhere(sizes, rules)
  for i = 1, n do
    use_semaphore(i)
    hold_all(i, now + lease_ms, sizes[i] == 0)
    record_start(rules[i], now, weight)
    redis.call('HSET', K_HOLDER_INFO, HOLDER_FIELD .. token, now .. INFO_SEPARATOR .. label)
    extend(K_HOLDER_INFO, lease_ms + GRACE_MS, sizes[i] == 0)
  end
end

if fresh then
  -- the fast path (a resend of it is harmless: the entries are set again, not added twice)
  local sizes, rules, room = {}, {}, true
  for i = 1, n do
    use_semaphore(i)
    sizes[i] = redis.call('ZCARD', K_HOLDERS)
    rules[i] = rules_in_force(ARGV[9 + i], now)
    -- under a rate, a spacing or a pause, nobody in line at all (see acquire's fast path)
    if sizes[i] + weight > rules[i].limit or redis.call('ZCARD', rules[i].gated and K_QUEUE or K_PRESENT) > 0
        or (rules[i].gated and gate_wait(rules[i], now, weight) > 0) then
      room = false
      break
    end
  end
  if room then
    hold_everywhere(sizes, rules)
    return granted()
  end
end

use_semaphore(1)
if redis.call('ZSCORE', K_HOLDERS, token) then
  -- a repeat of a granted try: extend, take nothing twice
  for i = 1, n do
    use_semaphore(i)
    redis.call('ZADD', K_HOLDERS, 'GT', now + lease_ms, unpack(members))
    extend(K_HOLDERS, lease_ms + GRACE_MS, false)
  end
  return granted()
end

local limits, rules, sizes = {}, {}, {}
local fits, short, short_free, retry_ms = true, nil, nil, 0
for i = 1, n do
  use_semaphore(i)
  purge(now)
  rules[i] = rules_in_force(ARGV[9 + i], now)
  limits[i] = rules[i].limit
  local heaviest = rules[i].rate_n > 0 and math.min(limits[i], rules[i].rate_n) or limits[i]
  if weight > heaviest then
    for j = 1, n do
      use_semaphore(j)
      drop_waiter(waiter)
    end
    return {TOO_HEAVY, i - 1, heaviest}
  end
  sizes[i] = redis.call('ZCARD', K_HOLDERS)
  local free = limits[i] - sizes[i]
  if free < weight and fits then
    fits, short = false, i
  end
  if rules[i].gated then
    -- offers out to waiters of one slot count as starts made (see startable)
    local wait = gate_wait(rules[i], now, weight + live_offers(now))
    if wait > 0 then
      retry_ms = math.max(retry_ms, wait)
      if fits then
        fits, short = false, i
      end
    end
  end
  if short_free == nil or free < short_free then
    short_free = free
  end
end

-- the ticket: the one it holds in some line, else the one it brings, else a new one
local ticket = nil
if enqueue then
  for i = 1, n do
    use_semaphore(i)
    ticket = redis.call('ZSCORE', K_QUEUE, waiter)
    if ticket then
      ticket = tonumber(ticket)
      break
    end
  end
  ticket = ticket or tonumber(ARGV[7])
  if not ticket then
    use_semaphore(1)
    ticket = new_ticket(now)
  end
end

local position, blocking = 0, short
for i = 1, n do
  use_semaphore(i)
  local ahead
  if enqueue then
    if not redis.call('ZSCORE', K_QUEUE, waiter) then
      redis.call('ZADD', K_QUEUE, ticket, waiter)
      redis.call('HSET', K_WAITER_INFO, WAITER_FIELD .. waiter, now .. INFO_SEPARATOR .. stored_address(wake))
    elseif wake ~= '' then
      -- another process (a re-sent copy) may ask now: tell it, not the one that asked before
      local info = redis.call('HGET', K_WAITER_INFO, WAITER_FIELD .. waiter) or ''
      local first, address = string.match(info, '^(%d*)|(.*)$')
      local kept = stored_address(wake)
      if address ~= kept then
        redis.call('HSET', K_WAITER_INFO, WAITER_FIELD .. waiter, (first ~= '' and first or now) .. INFO_SEPARATOR .. kept)
      end
    end
    redis.call('ZADD', K_PRESENT, ticket, waiter)
    redis.call('ZADD', K_DEADLINES, now + patience_ms, waiter)
    ahead = redis.call('ZRANK', K_PRESENT, waiter)
  else
    ahead = redis.call('ZCARD', K_PRESENT)
  end
  if ahead > 0 and blocking == nil then
    blocking = i
  end
  position = math.max(position, ahead)
end

if fits and position == 0 then
  for i = 1, n do
    use_semaphore(i)
    if enqueue then
      drop_waiter(waiter)
    end
    hold_all(i, now + lease_ms, sizes[i] == 0)
    record_start(rules[i], now, weight)
    redis.call('HSET', K_HOLDER_INFO, HOLDER_FIELD .. token, now .. INFO_SEPARATOR .. label)
    extend(K_HOLDER_INFO, lease_ms + GRACE_MS, sizes[i] == 0)
    -- this waiter headed the line: slots it left free go on to those behind it
    if enqueue and redis.call('ZCARD', K_PRESENT) > 0 then
      hand_off(now, rules[i], nil)
    end
  end
  return granted()
end

-- at the head of every line, held back only by a rate, a spacing or a pause: its place is kept
-- until it may start (and a claim window after), however short its patience
local start_wait = position == 0 and retry_ms or 0
if enqueue then
  for i = 1, n do
    use_semaphore(i)
    if start_wait > 0 then
      redis.call('ZADD', K_DEADLINES, 'GT', now + start_wait + CLAIM_MS, waiter)
    end
    extend_line(math.max(patience_ms, start_wait + CLAIM_MS) + GRACE_MS)
  end
end
-- a retry moment means something only to the head of every line: the others are told when
-- their weight fits (hand_off)
return {WAIT, position, short_free, limits[blocking or 1], (blocking or 1) - 1,
        ticket and string.format('%.0f', ticket) or '', start_wait, unpack(to_wake)}
