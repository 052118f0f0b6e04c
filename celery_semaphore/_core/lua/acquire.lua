-- acquire: one try for a slot, fair by ticket order, with hand-off of free slots.
--   KEYS    the semaphore keys (see _lib.lua)
--   ARGV[1] token        the holder token this try would hold the slot under
--   ARGV[2] waiter       the waiter id that keeps its place in line across tries (a task id)
--   ARGV[3] settings     "<rules>|<lease_ms>|<patience_ms>|<enqueue><fresh>|<label>", packed in one
--                        argument because a client pays for every argument it sends (redis-py
--                        encodes each one in Python), and these rarely change between calls:
--     rules        the limit (and rate and spacing) to apply where no runtime override is
--                  stored: "<limit>" or "<limit>/<rate count>/<rate ms>/<spacing ms>" (see
--                  rules_in_force in _lib.lua)
--     lease_ms     lease length for a granted slot
--     patience_ms  how long a refused waiter keeps its place without asking again
--     enqueue      "1": a new waiter takes a ticket; "0": a one-shot try that never queues and
--                  is granted only if it passes no present waiter; "2": *placing*, for a task
--                  being sent (fresh): a new waiter takes a ticket as with "1" but is never
--                  granted here. Where it would start now it is *offered* the start instead
--                  (untold) and answered FREE with its ticket: its sender sends it to its queue
--                  carrying the ticket, and its ask there claims the offer. Until then the offer
--                  counts as a slot taken and, under a rate or a spacing, as a start, so that a
--                  burst of sends is not all answered FREE, nor passes the ones in flight. A
--                  waiter already in line is answered {FREE, ""}: no place, no offer
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
--   ARGV[7] remember_ms  how long a granted run is remembered (counted from its grant); sent
--                        negative, the run is recorded finished at its grant (it runs at most
--                        once: no copy takes it over once this one's lease lapses)
--   ARGV[8] tenant       "" or "<share>|<tenant>": the caller's tenant and the share its settings
--                        give it (a runtime override in KEYS[14] wins): a new waiter's ticket is
--                        then its tenant's virtual time (see tenant_ticket), not its arrival.
--                        Two levels: "<share>|<org>|<user share>|<user>" (the user's runtime
--                        share is stored under "<org>/<user>"): the ticket is the org's virtual
--                        time, and the user's is kept in the levels key (see _tenants.lua)
--   ARGV[9] priority_ms  "" or the ms a new waiter is placed earlier than its ask (a priority;
--                        with a tenant, ms of its tenant's clock, 1000 ms a start at share 1)
--   ARGV[10] full        "" or "<max waiters>|<policy>|<coalesce key>", what a full line does
--                        (max may be "": no cap). A new waiter (no ticket yet) that finds max
--                        in line: "reject": takes no place, answered LINE_FULL (a purge this
--                        try made frees slots for those in line at their next ask);
--                        "drop_oldest": the oldest waiter not offered a slot is evicted and
--                        the new one joins. "keep_latest": a new waiter whose coalesce key
--                        another waiter has takes that one's ticket (its place), and that one
--                        is evicted; with none to replace, a full line rejects. An evicted
--                        waiter is told (notify), and answered EVICTED whenever it asks again
--                        (KEYS[15], for EVICTED_MS)
--   ARGV[4..10] may be left out when empty (read as ""); KEYS[11..12] are passed only with a run,
--   a tenant, a priority or a full-line policy, KEYS[13..14] only with a tenant or a policy,
--   KEYS[15] only with a policy:
--   KEYS[13] tenants     ZSET   tenant -> its clock: the ticket base of its latest waiter
--   KEYS[14] shares      HASH   tenant -> runtime share (set-share; no expiry, like KEYS[8])
--   KEYS[15] evicted     ZSET   waiter -> until when (server ms) it is answered EVICTED
-- Tickets are server time (ms) * 1024 plus a counter (mod 1024) for ties: ordered by first ask,
-- and still ordered after the counter key expired. A float holds them exactly (below 2^53).
-- Returns (the codes are named in _lib.lua), when granted, the bare integer outcome (GRANTED or
-- CLAIMED: the common answer stays short to parse), or {CLAIMED, to_wake...} when the claim
-- handed the next start on to a waiter nobody heard; for a duplicate run, {RUNNING, lease_ms}
-- (its other copy holds the slot now, its lease lasting lease_ms more unless renewed) or RAN
-- (the run finished); placing (enqueue "2") where a grant would come now, {FREE, ticket,
-- to_wake...}; when refused, {WAIT, position, free, limit, hold, ticket, turn, retry_ms,
-- opens_ms, to_wake...}:
--   outcome  GRANTED: the slot is held under token (also when token already held it, so a
--            resend by redis-py after a connection error is harmless); CLAIMED: granted by
--            claiming the offer a release made to this waiter; WAIT: refused
--   position the waiter's 0-based place in line, away waiters included (0 when granted)
--   free     free slots after this call (offers count as taken)
--   limit    the limit in force (override or the settings' limit)
--   hold     moving average of recent hold times in ms, or -1 while none is known (or granted)
--   ticket   the waiter's ticket as a decimal string ("" when granted or not queued)
--   turn     the waiter's 0-based place among present waiters: slots are offered by this
--   retry_ms 0; or, for a waiter holding a slot that a rate, a spacing or a pause reserved for
--            it (a delayed offer, see hand_off), the ms until it may claim it: it asks again
--            then, and nobody else can take that start meanwhile
--   opens_ms 0; or, while a rate, a spacing or a pause allows no start, the ms until the next
--            start is allowed (to whoever heads the line then): a caller far from its turn need
--            not wait in-process meanwhile
--   to_wake  the waiters this try offered a slot to whose wake-up nobody heard (see notify)

local token, waiter = ARGV[1], ARGV[2]
local spec, lease_ms, patience_ms, enqueue, fresh, label =
  string.match(ARGV[3], '^([%d/]+)|(%d+)|(%d+)|([012])([01])|(.*)$')
lease_ms, patience_ms = tonumber(lease_ms), tonumber(patience_ms)
local placing = enqueue == '2'
enqueue, fresh = enqueue ~= '0', fresh == '1'
local wake, run, remember_ms = ARGV[5] or '', ARGV[6] or '', tonumber(ARGV[7])
local run_begins = token  -- what the run's record holds from its grant: '' once it counts finished
if remember_ms and remember_ms < 0 then
  remember_ms, run_begins = -remember_ms, ''
end
local tenant_arg = ARGV[8] or ''
local priority_ms = tonumber(ARGV[9]) or 0
local max_waiters, full_policy, coalesce = string.match(ARGV[10] or '', '^(%d*)|([%w_]+)|(.*)$')
max_waiters = tonumber(max_waiters)

local now = now_ms()
local free_now  -- placing: the waiter would start now (see enqueue "2")

if run ~= '' then
  local taken, lease_left_ms = run_taken(run, token, now)
  if taken == 'ran' and (tonumber(redis.call('ZSCORE', K_HOLDERS, token)) or 0) > now then
    taken = nil  -- begun at most once under this very token, which holds it: a repeat of its grant
  end
  if taken == 'running' then
    return {RUNNING, lease_left_ms}
  elseif taken == 'ran' then
    return RAN
  end
end

-- Every grant goes through here: a start is noted for a rate or a spacing, and a run remembers
-- the token it got the slot under.
local function granted(code, r)
  record_start(r, now, 1)
  if run ~= '' then
    record_run(run, run_begins, now, remember_ms)
  end
  if #to_wake > 0 then
    return {code, unpack(to_wake)}
  end
  return code
end

-- a grant that is no new start (a repeat of one): nothing to note for a rate or a spacing
local NO_RULES = {rate_n = 0, spacing_ms = 0}

if placing and redis.call('ZSCORE', K_QUEUE, waiter) then
  -- a task id already in line (sent twice, a reused id): sent as it is, placed nowhere; its
  -- worker asks for it as for any delivery
  return {FREE, ''}
end

local r, size
if fresh then
  -- the fast path: a newcomer, nobody present to pass, a slot free, no rate, spacing or pause
  -- holding it back. Under such rules nobody in line at all: a waiter offered a start for a
  -- later moment is no longer present, yet that start is its own
  r = rules_in_force(spec, now)
  size = redis.call('ZCARD', K_HOLDERS)
  if size < r.limit and redis.call('ZCARD', r.gated and K_QUEUE or K_PRESENT) == 0
      and (not r.gated or gate_wait(r, now, 1) == 0) and (r.per_tenant == 0 or tenant_arg == '') then
    if placing then
      free_now = true
    else
      hold(token, now, lease_ms, label, size == 0)
      return granted(GRANTED, r)
    end
  end
  -- a one-shot try that finds every slot taken, none of them lapsed (what the purge would free)
  -- and none its own (a repeat of a granted try): refused here, before the line's helpers are
  -- made; the purge of waiters that stopped asking is left to the next try that joins the line.
  -- Then position and turn may still count such waiters.
  if not enqueue and size >= r.limit and redis.call('ZCOUNT', K_HOLDERS, -now, now) == 0
      and not redis.call('ZSCORE', K_HOLDERS, token) then
    return {WAIT, redis.call('ZCARD', K_QUEUE), r.limit - size, r.limit,
            tonumber(redis.call('HGET', K_WAITER_INFO, HOLD_FIELD)) or -1, '', redis.call('ZCARD', K_PRESENT),
            0, r.gated and gate_wait(r, now, 1) or 0}
  end
end

-- @rest-of-lib

-- Placing (enqueue "2"), for a waiter that would start now: in line and offered the start,
-- untold, so that its ask (carrying the ticket) claims it within the claim window.
local function sent_free(ticket)
  redis.call('ZADD', K_QUEUE, ticket, waiter)
  redis.call('ZADD', K_DEADLINES, now + math.max(patience_ms, CLAIM_MS), waiter)
  redis.call('HSET', K_WAITER_INFO, WAITER_FIELD .. waiter, now .. INFO_SEPARATOR)
  local claim_by = offer(waiter, now, now, false)
  extend(K_HOLDERS, claim_by - now + GRACE_MS, size == 0)
  extend_line(math.max(patience_ms, CLAIM_MS) + GRACE_MS)
  return {FREE, string.format('%.0f', ticket), unpack(to_wake)}
end

if free_now then
  return sent_free(new_ticket(now))
end

-- The helpers of a tenant and of a full line are made only for a call that carries one: a
-- plain call (most of them) pays nothing for making closures it never calls.
local make_room, tenant_ticket, returning_to_org
local K_EVICTED = KEYS[15]

if full_policy then
  -- A full line (ARGV[10]): an evicted waiter is told, and answered EVICTED for this long whenever
  -- it asks again (a Celery task's backstop copy comes back within minutes; an hour is ample)
  local EVICTED_MS = 3600000
  -- how many waiters from the head drop_oldest looks at for one not offered a slot
  local EVICT_SCAN = 10

  local function evict(victim, now)
    local address = wake_address(victim)
    drop_waiter(victim)
    redis.call('ZREMRANGEBYSCORE', K_EVICTED, '-inf', now)
    redis.call('ZADD', K_EVICTED, now + EVICTED_MS, victim)
    extend(K_EVICTED, EVICTED_MS + GRACE_MS, false)
    notify(address, victim)
  end

  local function is_offered(candidate)
    return redis.call('ZSCORE', K_HOLDERS, OFFER_MARK .. candidate) ~= false
  end

  -- A new waiter at a full line (see ARGV[10]): the ticket it takes over (keep_latest), or nil;
  -- or false when it must be answered LINE_FULL.
  make_room = function(now)
    local taken
    if full_policy == 'keep_latest' and coalesce ~= '' then
      local field = 'c:' .. coalesce
      local older = redis.call('HGET', K_WAITER_INFO, field)
      if older and older ~= waiter and not is_offered(older) then
        taken = tonumber(redis.call('ZSCORE', K_QUEUE, older))
        if taken then
          evict(older, now)
        end
      end
      redis.call('HSET', K_WAITER_INFO, field, waiter)
    end
    if taken or not max_waiters or redis.call('ZCARD', K_QUEUE) < max_waiters then
      return taken
    end
    if full_policy == 'drop_oldest' then
      local oldest = redis.call('ZRANGE', K_QUEUE, 0, EVICT_SCAN - 1)
      for i = 1, #oldest do
        if oldest[i] ~= waiter and not is_offered(oldest[i]) then
          evict(oldest[i], now)
          return nil
        end
      end
    end
    return false
  end
end

if tenant_arg ~= '' then
  -- A tenant's clocks only move on a contended ask (a waiter taking a place): starts on free slots
  -- with nobody waiting leave them, since there is nobody to be fair to.
  local K_TENANTS, K_SHARES = KEYS[13], KEYS[14]
  -- one start at share 1 moves a tenant's clock by this many tickets (shares up to 1000 keep a
  -- whole step); a multiple of 1024, so that ticket = clock + a tie-breaking counter below 1024
  local STEP_AT_SHARE_1 = 1000 * 1024
  -- an idle tenant's clock is kept this long after its last ask, then forgotten (so it comes back
  -- at the line's clock, as it would anyway)
  local TENANT_CLOCK_TTL_MS = 3600000

  -- Weighted fair queueing by virtual time, inside one line: a new waiter of a tenant is placed at
  -- max(the line's clock, its tenant's clock) + 1000 / share (in tickets of 1024). The line's clock
  -- is the clock of the head of the line, or, with nobody in line, the latest tenant clock: an idle
  -- tenant comes back there, with no credit saved up, while one that drained and comes back at
  -- once keeps its own clock. Clocks behind the line's are forgotten here (the same as absent), so
  -- idle tenants cost nothing. Ties between tenants break by the counter of new_ticket: by arrival
  -- (it wraps after 1024 asks, the only case in which two tied asks may swap).
  local function share_of(name, default_share)
    return tonumber(redis.call('HGET', K_SHARES, name)) or tonumber(default_share)
  end
  local function step_of(share)
    return math.max(1, math.floor(STEP_AT_SHARE_1 / 1024 / share + 0.5)) * 1024
  end

  -- Two levels: a waiter of "user" in "org" gets a user tag, the user's virtual time inside the
  -- org: one step (1000 / user share, in tickets) after the later of its user's last tag and
  -- the org's first tag still in line, so a user that joins the org's backlog late is served
  -- next, not behind the others' backlog, and one user's calls stay in their order; a priority
  -- moves it as it moves the ticket. The counter of "ticket" breaks ties by arrival. Stored in
  -- the levels key, and the org under TENANT_FIELD.
  local function place_in_org(org, user, user_share, ticket)
    local levels = levels_key()
    local org_tag = org_front(org, false)
    local prefix = user_prefix(org, user)
    local last = redis.call('ZRANGE', levels, '[' .. prefix .. '\255', '[' .. prefix, 'BYLEX', 'REV', 'LIMIT', 0, 1)
    local user_tag
    if #last > 0 then
      local tag, other = string.match(string.sub(last[1], #prefix + 1), '^(%d+)|(.*)$')
      if redis.call('ZSCORE', K_QUEUE, other) then
        user_tag = tonumber(tag)
      else
        drop_level_entries(org, tag, user, other)
      end
    end
    local base = math.max(org_tag or math.floor(ticket), user_tag or 0)
    local tag = string.format(TAG_FORMAT, math.floor(base / 1024) * 1024 + step_of(user_share)
                                          + math.floor(ticket) % 1024 - priority_ms * 1024)
    local org_entry, user_entry = level_entries(org, tag, user, waiter)
    redis.call('ZADD', levels, 0, org_entry, 0, user_entry)
    redis.call('HSET', K_WAITER_INFO, TENANT_FIELD .. waiter, org)
    extend(levels, LEVELS_TTL_MS, false)
  end

  tenant_ticket = function(now, share_and_tenant)
    local default_share, tenant, user_share, user = string.match(share_and_tenant, '^([^|]+)|([^|]*)|([^|]+)|(.*)$')
    if not tenant then
      default_share, tenant = string.match(share_and_tenant, '^([^|]+)|(.*)$')
    end
    local share = share_of(tenant, default_share)
    local head = redis.call('ZRANGE', K_QUEUE, 0, 0, 'WITHSCORES')
    local line_clock
    if #head > 0 then
      line_clock = math.floor(tonumber(head[2]) / 1024) * 1024
    else
      local latest = redis.call('ZRANGE', K_TENANTS, -1, -1, 'WITHSCORES')
      line_clock = #latest > 0 and tonumber(latest[2]) or now * 1024
    end
    local clock = math.max(line_clock, tonumber(redis.call('ZSCORE', K_TENANTS, tenant)) or 0) + step_of(share)
    redis.call('ZREMRANGEBYSCORE', K_TENANTS, '-inf', string.format('(%.0f', line_clock))
    redis.call('ZADD', K_TENANTS, clock, tenant)
    extend(K_TENANTS, TENANT_CLOCK_TTL_MS, false)
    local ticket = clock + new_ticket(now) % 1024 - priority_ms * 1024
    if user then
      ticket = ticket + LEVELED_TICKET
      place_in_org(tenant, user, share_of(tenant .. '/' .. user, user_share), ticket)
    end
    return ticket
  end

  -- A two-level waiter back in line at the ticket it was given before (it left, or lapsed): the
  -- ticket marked again as a two-level one, and a user tag placed anew.
  returning_to_org = function(share_and_tenant, ticket)
    local _, org, user_share, user = string.match(share_and_tenant, '^([^|]+)|([^|]*)|([^|]+)|(.*)$')
    if not org then
      return ticket
    end
    ticket = math.floor(ticket) + LEVELED_TICKET
    place_in_org(org, user, share_of(org .. '/' .. user, user_share), ticket)
    return ticket
  end
end

local average

-- A refusal: the place in line, what is free, and when to ask again if a slot waits for it.
local function refused(left, ticket, retry_ms)
  return {WAIT, redis.call('ZRANK', K_QUEUE, waiter) or redis.call('ZCARD', K_QUEUE), left, r.limit,
          average or tonumber(redis.call('HGET', K_WAITER_INFO, HOLD_FIELD)) or -1,
          ticket and string.format('%.0f', ticket) or '', redis.call('ZRANK', K_PRESENT, waiter) or 0,
          retry_ms, r.gated and gate_wait(r, now, 1) or 0, unpack(to_wake)}
end

if not fresh and redis.call('ZREM', K_HOLDERS, OFFER_MARK .. waiter) == 1 then
  -- a release offered this waiter a slot: take it, unless its start is not allowed yet (a
  -- delayed offer, or a pause set since): then the offer is kept for it until that moment
  r = rules_in_force(spec, now)
  local wait = r.gated and gate_wait(r, now, 1) or 0
  if wait > 0 then
    local claim_by = now + wait + CLAIM_MS
    redis.call('ZADD', K_HOLDERS, -claim_by, OFFER_MARK .. waiter)
    redis.call('ZADD', K_DEADLINES, 'GT', claim_by, waiter)
    extend(K_HOLDERS, wait + CLAIM_MS + GRACE_MS, false)
    extend_line(wait + CLAIM_MS + GRACE_MS)
    return refused(0, redis.call('ZSCORE', K_QUEUE, waiter), wait)
  end
  hold(token, now, lease_ms, label, false)
  note_grant(r, waiter, token, now)
  drop_waiter(waiter)
  if not r.gated then
    return granted(CLAIMED, r)
  end
  -- under a rate or a spacing no other waiter was offered this start: the next start goes to
  -- the next in line now, as a delayed offer for the moment it is allowed
  granted(CLAIMED, r)
  if redis.call('ZCARD', K_PRESENT) > 0 then
    hand_off(now, r, nil)
  end
  if #to_wake > 0 then
    return {CLAIMED, unpack(to_wake)}
  end
  return CLAIMED
end
r = r or rules_in_force(spec, now)
local purged = purge(now)
if redis.call('ZSCORE', K_HOLDERS, token) then
  -- a repeat of a granted try: the entry still counts, so extending it takes no second slot
  -- (nor a second start)
  redis.call('ZADD', K_HOLDERS, 'GT', now + lease_ms, token)
  extend(K_HOLDERS, lease_ms + GRACE_MS, false)
  return granted(GRANTED, NO_RULES)
end

-- the holders the fast path counted, less those the purge removed: nothing else has changed
-- them since, nor will until a grant below, so the hand-offs need not count them either
if size then
  size = size - purged
else
  size = redis.call('ZCARD', K_HOLDERS)
end
average = tonumber(redis.call('HGET', K_WAITER_INFO, HOLD_FIELD)) or -1

if not enqueue then
  local left, _, offered = hand_off(now, r, nil, size)
  local tenant, caps = r.per_tenant > 0 and tenant_named(tenant_arg), {}
  if left > 0 and not (tenant and held_count(caps, tenant, now) >= r.per_tenant) then
    hold(token, now, lease_ms, label, size == 0 and offered == 0)
    if tenant then
      note_held(caps, tenant, token, now)
    end
    return granted(GRANTED, r)
  end
  return {WAIT, redis.call('ZCARD', K_QUEUE), left, r.limit, average, '', redis.call('ZCARD', K_PRESENT), 0,
          r.gated and gate_wait(r, now, 1) or 0, unpack(to_wake)}
end

local ticket = redis.call('ZSCORE', K_QUEUE, waiter)
if ticket then
  ticket = tonumber(ticket)
  if wake ~= '' then
    local info = redis.call('HGET', K_WAITER_INFO, WAITER_FIELD .. waiter) or ''
    local first, address = string.match(info, '^(%d*)|(.*)$')
    local kept = stored_address(wake)
    if address ~= kept then
      redis.call('HSET', K_WAITER_INFO, WAITER_FIELD .. waiter, (first or now) .. INFO_SEPARATOR .. kept)
    end
  end
else
  ticket = tonumber(ARGV[4])
  if full_policy and ticket and (tonumber(redis.call('ZSCORE', K_EVICTED, waiter)) or 0) > now then
    return EVICTED  -- its place went to another (drop_oldest, keep_latest): it may not come back
  end
  if full_policy and not ticket then
    ticket = make_room(now)
    if ticket == false then
      return LINE_FULL
    end
  end
  if not ticket then
    if tenant_arg ~= '' then
      ticket = tenant_ticket(now, tenant_arg)
    else
      ticket = new_ticket(now - priority_ms)
    end
  elseif tenant_arg ~= '' then
    ticket = returning_to_org(tenant_arg, ticket)
  end
  redis.call('ZADD', K_QUEUE, ticket, waiter)
  redis.call('HSET', K_WAITER_INFO, WAITER_FIELD .. waiter, now .. INFO_SEPARATOR .. stored_address(wake))
  if r.per_tenant > 0 and tenant_arg ~= '' and ticket % 1 == 0 then  -- a two-level one has it
    redis.call('HSET', K_WAITER_INFO, TENANT_FIELD .. waiter, tenant_named(tenant_arg))
  end
end
redis.call('ZADD', K_PRESENT, ticket, waiter)
redis.call('ZADD', K_DEADLINES, now + patience_ms, waiter)

local left, chosen, offered, delayed, caps = hand_off(now, r, waiter, size)
if chosen and placing then
  note_grant(r, waiter, OFFER_MARK .. waiter, now, caps)
  return sent_free(ticket)
end
if chosen then
  note_grant(r, waiter, token, now, caps)
  drop_waiter(waiter)
  hold(token, now, lease_ms, label, size == 0 and offered == 0)
  return granted(GRANTED, r)
end
extend_line(math.max(patience_ms, delayed + CLAIM_MS) + GRACE_MS)
return refused(left, ticket, delayed)
