-- Shared helpers. scripts.py puts this text in front of every script, so each script still runs
-- as one EVALSHA: one round trip, atomic, no lock. It only defines locals, in two parts: what the
-- uncontended paths use, then (from the "@rest-of-lib" line on) the rest, which a script may put
-- after its fast path, so that an uncontended acquire or release does not pay for a dozen
-- closures it never calls (measured: about 1 us of Redis time per script run).
--
-- Key schema (the same KEYS positions in every script; KEYS[11] and KEYS[12] are passed only to
-- the scripts that touch them: acquire, release and renew with a run id, and reset. All keys of
-- one semaphore share one Redis Cluster hash tag, "{prefix}:{<key>}:..."):
--   KEYS[1] holders      ZSET   holder token -> lease deadline (server ms), and offers:
--                               "!<waiter>" -> minus its claim deadline (server ms). An offer
--                               is a slot handed to a waiter that has not claimed it yet; it
--                               counts against the limit. The sign keeps both kinds countable
--                               by ZCOUNT: live holders score above now, live offers below -now,
--                               and everything lapsed lies in [-now, now].
--   KEYS[2] holder_info  HASH   "h:<token>" -> "<granted ms>|<label>"
--   KEYS[3] queue        ZSET   waiter id -> ticket; rank = place in line, everyone waiting
--   KEYS[4] present      ZSET   waiter id -> ticket, for waiters asking now (or parked with an
--                               address): slots are offered to these only
--   KEYS[5] deadlines    ZSET   waiter id -> must-ask-by (server ms), or it loses its place
--   KEYS[6] waiter_info  HASH   "w:<waiter>" -> "<first ask ms>|<wake address>" (a channel, kept
--                               relative to the line, see stored_address; one ending in
--                               ":wake:s.<id>" is sharded, see notify), "hold" -> moving average
--                               of hold times (ms)
--   KEYS[7] ticket       STRING counter for tickets taken in the same millisecond (INCR)
--   KEYS[8] limit        STRING runtime limit override, if any (no expiry unless set with one)
--   KEYS[9] starts       LIST   when the latest starts were granted (server ms), newest first,
--                               one entry per slot: what a rate or a spacing is checked against
--                               (kept only while one is in force; at most 2 x the rate's count)
--   KEYS[10] gate        STRING runtime rate, spacing and pause: "r=<n>/<ms>", "s=<ms>" and
--                               "p=<until ms>" joined by ";", the first two each with an optional
--                               "@<until ms>" (see rules_in_force)
--   KEYS[11] runs        HASH   run id -> the token it was granted under, or "" once a holder
--                               of it released normally (the run finished): a waiter that may
--                               exist in several copies (a Celery wait re-sent twice) names its
--                               run, and a copy asking after another copy got the slot is told
--                               so (running, or done) instead of taking a second slot; a copy
--                               whose twin's lease is gone without that release (its process was
--                               killed) takes the run over
--   KEYS[12] run_expiry  ZSET   run id -> when its record is forgotten (server ms), counted from
--                               its grant, pushed on by each renewal of its lease, and counted
--                               again from its release
-- "<base>:levels" is never passed: _tenants.lua names it from KEYS[1]. No ARGV is shared.
--
-- Time is Redis server time only (TIME): client clocks never decide a deadline.
-- Every key a script writes gets an expiry in the same script ("extend"), never shorter than
-- the last live deadline it holds, so an idle semaphore leaves nothing behind.

local K_HOLDERS, K_HOLDER_INFO, K_QUEUE, K_PRESENT, K_DEADLINES, K_WAITER_INFO, K_TICKET, K_LIMIT =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]

local K_STARTS, K_GATE = KEYS[9], KEYS[10]

local K_RUNS, K_RUN_EXPIRY = KEYS[11], KEYS[12]

-- @storage-format: the codes the scripts answer with and the marks inside what they store.
-- _core/storage.py holds the same values under the same names for Python, and
-- tests/core/test_storage_format.py fails if the two differ or if a script uses a bare code where a
-- name exists below. One "local NAME = value" per line, up to the blank line that ends the block.
-- Each costs a script run one instruction to declare; reading one costs what the literal did
-- (uncontended acquire + release measured the same, about 6.5 us of Redis time per EVALSHA).
-- acquire and acquire_many: how a try ended
local WAIT = 0
local GRANTED = 1
local CLAIMED = 2
local RUNNING = 3
local RAN = 4
local TOO_HEAVY = 5
local LINE_FULL = 6
local EVICTED = 7
local FREE = 8
-- renew and renew_many: one code per token
local RENEW_LOST = 0
local RENEW_RENEWED = 1
local RENEW_REGISTERED_AGAIN = 2
-- take_over: what became of the instance to take over
local INSTANCE_GONE = 0
local INSTANCE_BEATING = 1
local INSTANCE_TAKEN = 2
-- status: the state of a waiter
local AWAY = 0
local PRESENT = 1
local OFFERED = 2
-- the marks of the key schema above
local OFFER_MARK = '!'
local EXTRA_SLOT_MARK = '#'
local HOLDER_FIELD = 'h:'
local WAITER_FIELD = 'w:'
local TENANT_FIELD = 't:'
local HELD_FIELD = 'held:'
local HOLD_FIELD = 'hold'
local INFO_SEPARATOR = '|'
local PARKED_MARK = '>'
local RECORD_SEPARATOR = '\n'
local WOKEN_COPY_MARK = 'woken\n'
local TAKEN_RECORD_MARK = '~'
-- the weight of a waiter "*<w>*<id>" and of a token "<token>*<w>"; a wake address of a sharded
-- listener, and one of a cluster listener without sharded pub/sub (see notify)
local WEIGHTED_WAITER_PATTERN = '^%*(%d+)%*'
local WEIGHTED_TOKEN_PATTERN = '%*(%d+)$'
local SHARDED_ADDRESS_PATTERN = ':wake:s%.[^:]*$'
local CLUSTER_ADDRESS_PATTERN = ':wake:c%.[^:]*$'

-- keys outlive the last deadline they hold by this much, so a reader right at a deadline sees
-- a consistent set instead of half-expired keys
local GRACE_MS = 1000
-- the parked-task records outlive their last due time by this much: a sweep that comes late (a
-- busy process sweeps only when its sender thread idles) still finds them
local SWEEP_GRACE_MS = 60000
local CLAIM_MS = 2000  -- how long an offered waiter has to claim its slot before it goes on
local PURGE_STEP = 100  -- most entries one purge step removes: never growing with the line
local TICKET_TTL_MS = 1000  -- the ticket counter only breaks ties within one millisecond

-- PEXPIRE ... GT exists from Redis 7.0, as do REDIS_VERSION_NUM and SPUBLISH (see notify)
local HAS_GT = redis.REDIS_VERSION_NUM ~= nil

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The rules in force on this semaphore, from "spec" (what the caller's code declares: "<limit>",
-- or "<limit>/<rate count>/<rate ms>/<spacing ms>[/<per tenant>]", 0 for none) and the runtime
-- overrides stored in K_LIMIT and K_GATE (one MGET: the same one call that reading the limit
-- alone cost). Returns a table: limit; rate_n starts at most in any rate_ms (0: no rate);
-- spacing_ms at least between two starts (0: none); paused_until (server ms, 0: not paused);
-- gated: whether any of the last three holds starts back, which only then costs calls;
-- per_tenant: most slots one tenant's waiters may hold (0: no cap, see _tenants.lua).
local function rules_in_force(spec, now)
  local limit, rate_n, rate_ms, spacing_ms, per_tenant = string.match(spec, '^(%d+)/(%d+)/(%d+)/(%d+)/?(%d*)$')
  local r
  if limit then
    r = {limit = tonumber(limit), rate_n = tonumber(rate_n), rate_ms = tonumber(rate_ms),
         spacing_ms = tonumber(spacing_ms), paused_until = 0, per_tenant = tonumber(per_tenant) or 0}
  else
    r = {limit = tonumber(spec), rate_n = 0, rate_ms = 0, spacing_ms = 0, paused_until = 0, per_tenant = 0}
  end
  local stored = redis.call('MGET', K_LIMIT, K_GATE)
  if stored[1] then
    r.limit = tonumber(stored[1])
  end
  if stored[2] then
    for kind, value, until_ms in string.gmatch(stored[2], '(%a)=([%d/]+)@?(%d*)') do
      if until_ms == '' or tonumber(until_ms) > now then
        if kind == 'r' then
          local n, ms = string.match(value, '^(%d+)/(%d+)$')
          r.rate_n, r.rate_ms = tonumber(n), tonumber(ms)
        elseif kind == 's' then
          r.spacing_ms = tonumber(value)
        elseif kind == 'p' and tonumber(value) > now then
          r.paused_until = tonumber(value)
        end
      end
    end
  end
  r.gated = r.rate_n > 0 or r.spacing_ms > 0 or r.paused_until > 0
  return r
end

-- How many ms until "weight" more starts may be granted under the rules r (0: now), from the
-- pause, the latest start (spacing) and the start that must have left the rate's window. A
-- window of rate_ms holds at most rate_n starts: with the starts newest first, the one at index
-- rate_n - weight must lie rate_ms or more in the past. A weight above rate_n never fits.
-- A pause until resumed (or any wait over a day) reads as a day: a delayed offer for then is
-- made again then, if the pause still holds.
local LONGEST_WAIT_MS = 86400000
local function gate_wait(r, now, weight)
  local wait = 0
  if r.paused_until > now then
    wait = r.paused_until - now
  end
  if r.spacing_ms > 0 then
    local last = tonumber(redis.call('LINDEX', K_STARTS, 0))
    if last and last + r.spacing_ms - now > wait then
      wait = last + r.spacing_ms - now
    end
  end
  if r.rate_n > 0 then
    if weight > r.rate_n then
      return math.max(wait, r.rate_ms)
    end
    local oldest = tonumber(redis.call('LINDEX', K_STARTS, r.rate_n - weight))
    if oldest and oldest + r.rate_ms - now > wait then
      wait = oldest + r.rate_ms - now
    end
  end
  return math.min(wait, LONGEST_WAIT_MS)
end

-- Note a grant of "weight" slots now, for the rate and the spacing (nothing without either).
-- The list is trimmed back to the rate's count once it holds twice that: one LTRIM per rate_n
-- starts instead of one per start. It lives as long as the longer of the two windows.
local function record_start(r, now, weight)
  if r.rate_n == 0 and r.spacing_ms == 0 then
    return
  end
  local stamps = {}
  for k = 1, weight do
    stamps[k] = now
  end
  local length = redis.call('LPUSH', K_STARTS, unpack(stamps))
  local keep = math.max(r.rate_n, 1)
  if length > 2 * keep then
    redis.call('LTRIM', K_STARTS, 0, keep - 1)
  end
  redis.call('PEXPIRE', K_STARTS, math.max(r.rate_ms, r.spacing_ms) + GRACE_MS)
end

-- Make sure "key" lives at least ttl_ms more, never shortening a longer expiry (holders with
-- different lease lengths share the key): one PTTL when the expiry covers ttl_ms, as for most
-- writes under load; otherwise the expiry moves to ttl_ms and a quarter more (EXTEND_AHEAD), so
-- the writes within that quarter find it covered in turn (docs/design.md, "Key expiry"). is_new:
-- the script created the key, so it has no expiry yet (no PTTL needed).
local EXTEND_AHEAD = 0.25
local function extend(key, ttl_ms, is_new)
  if not is_new then
    local left = redis.call('PTTL', key)
    if left >= ttl_ms or left == -2 then
      return
    end
  end
  redis.call('PEXPIRE', key, ttl_ms + math.floor(ttl_ms * EXTEND_AHEAD))
end

-- Put a holder in: the one way a slot is taken (grant, claim, reclaim). A grant or a claim is a
-- start (record_start), a reclaim is not: its holder has been running all along.
local function hold(token, now, lease_ms, label, holders_were_empty)
  redis.call('ZADD', K_HOLDERS, now + lease_ms, token)
  redis.call('HSET', K_HOLDER_INFO, HOLDER_FIELD .. token, now .. INFO_SEPARATOR .. label)
  extend(K_HOLDERS, lease_ms + GRACE_MS, holders_were_empty)
  extend(K_HOLDER_INFO, lease_ms + GRACE_MS, holders_were_empty)
end

-- Runs (K_RUNS, K_RUN_EXPIRY): of the copies of one Celery wait, exactly one runs. Whether a copy
-- asking under "run" with "token" must not run now: 'running' (another copy holds the slot now;
-- also returned: how many ms its lease has left, after which this copy may look again), 'ran'
-- (the run finished: a copy released it normally, or a worker marked it finished because Celery
-- will not deliver it again), or nil (no other copy, or the other's lease went without a release:
-- its process was killed mid-run, and this copy, a redelivery say, runs it after all).
-- K_HOLDERS must point at the semaphore the run's token holds.
local function run_taken(run, token, now)
  local previous = redis.call('HGET', K_RUNS, run)
  if not previous or previous == token then
    return nil
  end
  local forget_at = tonumber(redis.call('ZSCORE', K_RUN_EXPIRY, run))
  if not forget_at or forget_at <= now then
    return nil
  end
  if previous == '' then
    return 'ran'
  end
  local deadline = tonumber(redis.call('ZSCORE', K_HOLDERS, previous))
  if deadline and deadline > now then
    return 'running', deadline - now
  end
  return nil
end

-- Record a run for remember_ms: the token it was granted under, or '' once a holder of it
-- released normally (the run finished). Lapsed records go a bounded step at a time.
local function record_run(run, value, now, remember_ms)
  local old = redis.call('ZRANGEBYSCORE', K_RUN_EXPIRY, '-inf', now, 'LIMIT', 0, PURGE_STEP)
  if #old > 0 then
    redis.call('ZREM', K_RUN_EXPIRY, unpack(old))
    redis.call('HDEL', K_RUNS, unpack(old))
  end
  redis.call('HSET', K_RUNS, run, value)
  redis.call('ZADD', K_RUN_EXPIRY, now + remember_ms, run)
  extend(K_RUNS, remember_ms + GRACE_MS, false)
  extend(K_RUN_EXPIRY, remember_ms + GRACE_MS, false)
end

-- A renewal of the lease "token" holds for "run": the run's record lives at least as long as
-- the lease (GT never shortens it), so that a copy of a run longer than the time a record is
-- remembered is still told 'running', never handed the run a second time. A record that names
-- another token (a copy took the run over) or says the run finished is left alone; one that is
-- gone (Redis restarted empty) is written again, as the slot itself is reclaimed.
local function keep_run(run, token, now, ttl_ms)
  local previous = redis.call('HGET', K_RUNS, run)
  if previous and previous ~= token then
    return
  end
  if not previous then
    redis.call('HSET', K_RUNS, run, token)
  end
  redis.call('ZADD', K_RUN_EXPIRY, 'GT', now + ttl_ms, run)
  extend(K_RUNS, ttl_ms + GRACE_MS, false)
  extend(K_RUN_EXPIRY, ttl_ms + GRACE_MS, false)
end

-- One token's answer to a renewal (renew, renew_many): its code, and its run's record kept on
-- while it holds.
local function answer_renewal(codes, code, run, token, now, lease_ms)
  if code ~= RENEW_LOST and run ~= '' then
    keep_run(run, token, now, lease_ms)
  end
  codes[#codes + 1] = code
end

-- The waiters offered a slot whom the script's caller wakes: parked, or nobody heard (see notify),
-- listed in a script's reply; and whether the caller takes the parked ones' records itself.
local to_wake, caller_takes_parked = {}, false

-- @rest-of-lib
-- The rest: the line, offers and hand-off, wake-ups, purges, several semaphores. A script that
-- has this marker line in its own text gets what follows there (after its fast path), any other
-- script here, before its body (scripts.script_source).

-- extend for a key whose every write moves its deadline further out than the last (the
-- parked-task records of park and claim_parked_waiter): one PEXPIRE GT on Redis 7 (the exact
-- deadline, nothing ahead); a PTTL first where GT refused, or on Redis 6.2, which has no GT.
local function extend_exactly(key, ttl_ms)
  if HAS_GT then
    if redis.call('PEXPIRE', key, ttl_ms, 'GT') == 0 and redis.call('PTTL', key) == -1 then
      redis.call('PEXPIRE', key, ttl_ms)
    end
  else
    local left = redis.call('PTTL', key)
    if left == -1 or (left >= 0 and left < ttl_ms) then
      redis.call('PEXPIRE', key, ttl_ms)
    end
  end
end

-- A new place in line: server milliseconds * 1024 plus a counter of that moment's tickets (the
-- counter lives a second), so that tickets sort by first ask and two asks never tie.
local function new_ticket(now)
  local counter = redis.call('INCR', K_TICKET)
  if counter == 1 then
    redis.call('PEXPIRE', K_TICKET, TICKET_TTL_MS)
  end
  return now * 1024 + counter % 1024
end

-- The scripts over several semaphores (acquire_many, release_many, renew_many, leave_many) pass
-- 10 keys per semaphore, in the order above, semaphore after semaphore. use_semaphore(i) points
-- every helper at the i-th of them (1-based): the helpers read these locals, so one
-- script reuses them for each semaphore in turn. The single-semaphore scripts never call it.
local KEYS_PER_SEMAPHORE = 10
local function use_semaphore(i)
  local b = (i - 1) * KEYS_PER_SEMAPHORE
  K_HOLDERS, K_HOLDER_INFO, K_QUEUE, K_PRESENT, K_DEADLINES, K_WAITER_INFO, K_TICKET, K_LIMIT =
    KEYS[b + 1], KEYS[b + 2], KEYS[b + 3], KEYS[b + 4], KEYS[b + 5], KEYS[b + 6], KEYS[b + 7], KEYS[b + 8]
  K_STARTS, K_GATE = KEYS[b + 9], KEYS[b + 10]
end

-- A waiter of acquire_many (several semaphores, or a weight) has an id "*<weight>*<rest>". It is
-- never offered a slot: it takes all its slots at once, in its own script, when it heads the line
-- of every one of its semaphores. Until then it blocks the line behind it (strict first-ask
-- order: a heavy waiter at the head is not passed by light ones).
local function multi_weight(waiter)
  return tonumber(string.match(waiter, WEIGHTED_WAITER_PATTERN))
end

-- A holder of several slots (acquire_many with a weight w > 1) has a token ending in "*<w>" and
-- holds w entries in KEYS[1]: the token, then "<token>#2" .. "<token>#w", so that ZCARD still
-- counts slots. Returns the entries of a token (just the token for an ordinary holder).
local function slot_members(token)
  local weight = tonumber(string.match(token, WEIGHTED_TOKEN_PATTERN)) or 1
  local members = {token}
  for k = 2, weight do
    members[k] = token .. EXTRA_SLOT_MARK .. k
  end
  return members
end

-- The one place a waiter is told something: publish its id on its wake address, a channel
-- inside the semaphore's hash tag ("{prefix}:{<name>}:wake:<listener id>", so in this script's
-- slot). A listener on a Redis >= 7 cluster subscribes with SSUBSCRIBE and marks its id "s."
-- (_wakeups.SHARDED_MARK): an address ending in ":wake:s.<id>" is told with SPUBLISH, which goes
-- to the one shard owning the slot instead of over the whole cluster bus; any other address with
-- PUBLISH. A server before 7 has no SPUBLISH: there it PUBLISHes (nobody hears it; the waiter's
-- own asks every patience/3 cover it) rather than fail the script.
-- A waiter nobody heard (its process gone, a pool child recycled, its listener reconnecting) is
-- added to "to_wake", which the scripts that hand slots on return: their caller sends a parked
-- task's wake copy itself (_parking.wake_offered), so the offer is claimed in milliseconds, not
-- lapsing. PUBLISH on a cluster counts one node's subscribers only: an address marked "c." (a
-- cluster listener without sharded pub/sub) is never judged unheard. ("to_wake" is declared
-- before "@rest-of-lib": a script's fast path may report it.) A parked waiter (PARKED_MARK in
-- front, see leave.lua) is added heard or not: the caller, running, sends the wake copy at once,
-- while the task's own process may be busy with another task for tens of ms (15-60 ms measured
-- under load). Both are told; whichever takes the record first sends (claim_parked_waiter.lua).
local function is_parked(address)
  return address ~= nil and string.sub(address, 1, 1) == PARKED_MARK
end

local function notify(address, waiter)
  if address and address ~= '' then
    local parked = is_parked(address)
    if parked then
      address = string.sub(address, 2)
    end
    -- its record taken by the caller: "~<waiter>" (a waiter of several keys: its process takes it)
    local told = (parked and caller_takes_parked and not string.find(waiter, WEIGHTED_WAITER_PATTERN)) and TAKEN_RECORD_MARK .. waiter or waiter
    local heard
    if HAS_GT and string.find(address, SHARDED_ADDRESS_PATTERN) then
      heard = redis.call('SPUBLISH', address, told)
    else
      heard = redis.call('PUBLISH', address, told)
      if string.find(address, CLUSTER_ADDRESS_PATTERN) then
        heard = 1
      end
    end
    if heard == 0 or parked then
      to_wake[#to_wake + 1] = waiter
    end
  end
end

-- waiter_info keeps an address of the line's own base, "<base>:wake:<id>", as ":wake:<id>": the
-- base once per line, not per waiter (40-odd bytes each in a long line); any other one whole.
local function line_base()  -- (K_WAITER_INFO is "<base>:waiter_info")
  return string.sub(K_WAITER_INFO, 1, -13)
end
local function stored_address(address)
  local head = line_base() .. ':wake:'
  return string.sub(address, 1, #head) == head and string.sub(address, #head - 5) or address
end

-- A waiter's wake address, whole: a parked waiter's behind PARKED_MARK (see notify).
local function wake_address(waiter)
  local address = string.match(redis.call('HGET', K_WAITER_INFO, WAITER_FIELD .. waiter) or '', '^%d*|(.*)$')
  local mark = is_parked(address) and PARKED_MARK or ''
  local rest = address and string.sub(address, #mark + 1)
  return rest and string.sub(rest, 1, 6) == ':wake:' and mark .. line_base() .. rest or address
end

-- Each of "items" behind "prefix" (then each behind "second", if given).
local function prefixed(items, prefix, second)
  local out = {}
  for i = 1, #items do
    out[i] = prefix .. items[i]
    out[#items + i] = second and second .. items[i] or nil
  end
  return out
end

-- When the line has emptied, its counter goes at once; the rest of its bookkeeping (the hold
-- average) goes too once nobody holds either, so an idle semaphore leaves no key behind. While
-- holders remain, the average is kept for the next line: releases keep updating it.
local function forget_line_if_empty()
  if redis.call('ZCARD', K_QUEUE) == 0 then
    redis.call('DEL', K_TICKET, levels_key())
    if redis.call('ZCARD', K_HOLDERS) == 0 then
      redis.call('DEL', K_WAITER_INFO)
    end
  end
end

-- Take a waiter out of the line entirely (granted, or gave up). Returns 1 if it was in line.
local function drop_waiter(waiter)
  local left = redis.call('ZREM', K_QUEUE, waiter)
  redis.call('ZREM', K_PRESENT, waiter)
  redis.call('ZREM', K_DEADLINES, waiter)
  redis.call('HDEL', K_WAITER_INFO, WAITER_FIELD .. waiter, TENANT_FIELD .. waiter)
  forget_line_if_empty()
  return left
end

-- One bounded step of removing lapsed holders, lapsed offers and waiters that stopped asking.
-- Returns how many entries of K_HOLDERS (leases or offers) went, i.e. how many slots it freed:
-- a caller that counted the holders before need not count them again.
-- An offer that lapsed unclaimed to a waiter still parked (its address marked, see notify) was
-- not acted on by whoever was told (a caller without a wake handler, or a process that heard
-- it and then exited, recycled or killed, before sending the wake copy): the waiter is added
-- to "to_wake" again, so that the caller sends its wake copy from the record kept in Redis,
-- if still there, and it comes back a claim window late instead of at its backstop.
local function purge(now)
  local freed = 0
  local dead = redis.call('ZRANGEBYSCORE', K_HOLDERS, -now, now, 'LIMIT', 0, PURGE_STEP)
  if #dead > 0 then
    freed = redis.call('ZREM', K_HOLDERS, unpack(dead))
    redis.call('HDEL', K_HOLDER_INFO, unpack(prefixed(dead, HOLDER_FIELD)))
    for i = 1, #dead do
      if string.sub(dead[i], 1, 1) == OFFER_MARK then
        local waiter = string.sub(dead[i], 2)
        if is_parked(wake_address(waiter)) then
          to_wake[#to_wake + 1] = waiter
        end
      end
    end
  end
  local gone = redis.call('ZRANGEBYSCORE', K_DEADLINES, '-inf', now, 'LIMIT', 0, PURGE_STEP)
  if #gone > 0 then
    redis.call('ZREM', K_DEADLINES, unpack(gone))
    redis.call('ZREM', K_QUEUE, unpack(gone))
    redis.call('ZREM', K_PRESENT, unpack(gone))
    redis.call('HDEL', K_WAITER_INFO, unpack(prefixed(gone, WAITER_FIELD, TENANT_FIELD)))
    -- an offer never outlives its waiter's place (its claim deadline is capped by it), but a
    -- waiter that lapsed must not keep a slot either way
    freed = freed + redis.call('ZREM', K_HOLDERS, unpack(prefixed(gone, OFFER_MARK)))
    forget_line_if_empty()
  end
  return freed
end

-- Offer a free slot to one present waiter: it leaves the present set (it is not offered twice)
-- but keeps its place in the queue, so that if it claims too late it still comes back first.
-- "opens_at": the moment its start is allowed (a rate, a spacing or a pause holds it until then;
-- now otherwise): the offer reserves the slot and that moment for it, and it may claim from then
-- on, for CLAIM_MS. Its place is kept at least as long. "tell": publish the offer (not when the
-- waiter is the one asking). Returns the claim deadline.
local function offer(waiter, now, opens_at, tell)
  local claim_by = opens_at + CLAIM_MS
  local must_ask_by = tonumber(redis.call('ZSCORE', K_DEADLINES, waiter))
  if opens_at > now then
    redis.call('ZADD', K_DEADLINES, 'GT', claim_by, waiter)
  elseif must_ask_by and must_ask_by < claim_by then
    claim_by = must_ask_by
  end
  redis.call('ZREM', K_PRESENT, waiter)
  redis.call('ZADD', K_HOLDERS, -claim_by, OFFER_MARK .. waiter)
  if tell then
    notify(wake_address(waiter), waiter)
  end
  return claim_by
end

-- Offers made and not claimed yet: each will be a start, so a rate or a spacing counts them.
local function live_offers(now)
  return redis.call('ZCOUNT', K_HOLDERS, '-inf', string.format('(%.0f', -now))
end

-- How many of "free" slots may go to waiters now under a rate, a spacing or a pause (the
-- rules r are gated); and when none may, how many ms until one may. Offers out count as starts
-- already made; a spacing allows one start (or offer) at a time.
local function startable(r, now, free)
  local offers = live_offers(now)
  local most = free
  if r.spacing_ms > 0 then
    most = offers == 0 and math.min(free, 1) or 0
  end
  local count = 0
  while count < most and gate_wait(r, now, offers + count + 1) == 0 do
    count = count + 1
  end
  if count > 0 or offers > 0 then
    return count, 0
  end
  return 0, gate_wait(r, now, 1)
end

-- Hand free slots to the oldest present waiters, one offer each, each told alone. "except" (a
-- waiter asking in this very script) is not offered: the caller grants it directly. Returns
-- (slots still free, whether "except" was among the first in line for them, offers made, and
-- the ms until "except" may claim the slot a rate, a spacing or a pause reserved it (0: none),
-- and under a cap per tenant the counts it read, for its caller's notes). Under such rules, while no start is allowed now and no offer is out, the head of the line is
-- offered the next allowed moment at once (a delayed offer): nobody behind it can take that
-- moment, and it is told now, so it can be back by then. "size": the entries of K_HOLDERS when
-- the caller has just counted them (nil: counted here).
local function hand_off(now, r, except, size)
  size = size or redis.call('ZCARD', K_HOLDERS)
  local free = r.limit - size
  if free <= 0 then
    return free, false, 0, 0
  end
  local opens_at = now
  if r.gated then
    -- one more than those present: a one-shot try asking in this script may take one
    local present = redis.call('ZCARD', K_PRESENT)
    local allowed, wait = startable(r, now, math.min(free, present + 1))
    if allowed == 0 then
      if wait == 0 then
        return 0, false, 0, 0  -- an offer out is the next start: the rest wait behind it
      end
      free, opens_at = 1, now + wait
    else
      free = allowed
    end
  end
  -- the first present waiters with their tickets (see _tenants.lua for caps and two levels)
  local caps = r.per_tenant > 0 and {} or nil
  local first = present_window(caps, free)
  local one_by_one = any_leveled(first)
  local latest, chosen, offered, delayed = 0, false, 0, 0
  local i = 1
  while i < #first and free > 0 do
    local waiter = first[i]
    local capped, tenant = capped_out(caps, waiter, r, now)
    if capped or (chosen and waiter == except) then
      i = i + 2  -- its tenant holds its cap, or it was granted in its own script
    else
      waiter = one_by_one and org_turn(waiter, first[i + 1]) or waiter
      local weight = multi_weight(waiter)
      if weight then
        -- a waiter of several slots or semaphores heads the line: told when its weight fits
        if free >= weight then
          notify(wake_address(waiter), waiter)
        end
        free = 0
        break
      end
      if waiter == except and opens_at == now then
        chosen = true  -- stays present until its caller grants it
      else
        latest = math.max(latest, offer(waiter, now, opens_at, waiter ~= except))
        offered = offered + 1
        if waiter == except then
          delayed = opens_at - now
        end
      end
      note_given(caps, tenant, waiter, not chosen or waiter ~= except, now)
      free = free - 1
      i = i + 2
      if one_by_one and free > 0 then
        first, i = present_window(caps, free + 1), 1
      end
    end
  end
  if offered > 0 then
    extend(K_HOLDERS, latest - now + GRACE_MS, size == 0)
  end
  if opens_at > now then
    free = 0  -- the one start to come is reserved: nobody else may take a slot now
  end
  return free, chosen, offered, delayed, caps
end

-- Purge one step, then hand freed slots on. The common ending of every script that may have
-- freed a slot.
local function settle(now, r)
  purge(now)
  if redis.call('ZCARD', K_PRESENT) > 0 then
    hand_off(now, r, nil)
  end
end

-- The first "most" live holders by lease deadline, for a reader (status, why): a flat list of
-- token, lease deadline ms, "<granted ms>|<label>" (or ""). "above": "(<now>", as ZRANGEBYSCORE
-- takes it.
local function listed_holders(above, most)
  local holders = {}
  local live = redis.call('ZRANGEBYSCORE', K_HOLDERS, above, '+inf', 'WITHSCORES', 'LIMIT', 0, most)
  for i = 1, #live, 2 do
    holders[#holders + 1] = live[i]
    holders[#holders + 1] = live[i + 1]
    holders[#holders + 1] = redis.call('HGET', K_HOLDER_INFO, HOLDER_FIELD .. live[i]) or ''
  end
  return holders
end

-- Keep the waiter-side keys alive at least ttl_ms more.
local function extend_line(ttl_ms)
  extend(K_QUEUE, ttl_ms, false)
  extend(K_PRESENT, ttl_ms, false)
  extend(K_DEADLINES, ttl_ms, false)
  extend(K_WAITER_INFO, ttl_ms, false)
end
