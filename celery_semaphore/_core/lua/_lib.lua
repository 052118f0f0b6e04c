-- Shared helpers. scripts.py puts this text in front of every script, so each script still
-- runs as one EVALSHA: one round trip, atomic, no lock around it. Nothing here runs by itself:
-- it only defines locals. It comes in two parts: what the uncontended paths use, then (from the
-- "@rest-of-lib" line on) the rest, which a script may place after its fast path instead, so an
-- uncontended acquire or release does not pay for making a dozen closures it never calls
-- (measured: about 1 us of Redis time per script run).
--
-- Key schema (the same KEYS positions in every script; KEYS[9] and KEYS[10] are passed only to
-- the scripts that touch them: acquire with a run id, and reset. All keys of one semaphore share
-- one Redis Cluster hash tag, "{prefix}:{<key>}:..."):
--   KEYS[1] holders      ZSET   holder token -> lease deadline (server ms), and offers:
--                               "!<waiter>" -> minus its claim deadline (server ms). An offer
--                               is a slot handed to a waiter that has not claimed it yet; it
--                               counts against the limit. The sign keeps both kinds countable
--                               by ZCOUNT: live holders score above now, live offers below -now,
--                               and everything lapsed lies in [-now, now].
--   KEYS[2] holder_info  HASH   "h:<token>" -> "<granted ms>|<label>"
--   KEYS[3] queue        ZSET   waiter id -> ticket; rank = place in line, everyone waiting
--   KEYS[4] present      ZSET   waiter id -> ticket, for waiters asking now; slots are offered
--                               to these only (a waiter away on a Celery countdown keeps its
--                               place in KEYS[3] but is offered nothing until it is back)
--   KEYS[5] deadlines    ZSET   waiter id -> must-ask-by (server ms); a waiter that does not
--                               ask again by then loses its place
--   KEYS[6] waiter_info  HASH   "w:<waiter>" -> "<first ask ms>|<wake address>" (a channel;
--                               one ending in ":wake:s.<id>" is sharded, see notify),
--                               "hold" -> moving average of hold times (ms)
--   KEYS[7] ticket       STRING counter for tickets taken in the same millisecond (INCR)
--   KEYS[8] limit        STRING runtime limit override, if any (no expiry unless set with one)
--   KEYS[9] runs         HASH   run id -> the token it was granted under, or "" once a holder
--                               of it released normally (the run finished): a waiter that may
--                               exist in several copies (a Celery wait re-sent twice) names its
--                               run, and a copy asking after another copy got the slot is told
--                               so (running, or done) instead of taking a second slot; a copy
--                               whose twin's lease is gone without that release (its process was
--                               killed) takes the run over
--   KEYS[10] run_expiry  ZSET   run id -> when its record is forgotten (server ms), counted from
--                               its grant and again from its release
-- No ARGV is shared: each script documents its own.
--
-- Time is Redis server time only (TIME): client clocks never decide a deadline.
-- Every key a script writes gets an expiry in the same script ("extend"), never shorter than
-- the last live deadline it holds, so an idle semaphore leaves nothing behind.

local K_HOLDERS, K_HOLDER_INFO, K_QUEUE, K_PRESENT, K_DEADLINES, K_WAITER_INFO, K_TICKET, K_LIMIT =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]

local K_RUNS, K_RUN_EXPIRY = KEYS[9], KEYS[10]

-- @storage-format: the codes the scripts answer with and the marks inside what they store.
-- _core/storage.py holds the same values under the same names for Python, and
-- tests/test_storage_format.py fails if the two differ or if a script uses a bare code where a
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
-- renew and renew_many: one code per token
local RENEW_LOST = 0
local RENEW_RENEWED = 1
local RENEW_REGISTERED_AGAIN = 2
-- status: the state of a waiter
local AWAY = 0
local PRESENT = 1
local OFFERED = 2
-- the marks of the key schema above
local OFFER_MARK = '!'
local EXTRA_SLOT_MARK = '#'
local HOLDER_FIELD = 'h:'
local WAITER_FIELD = 'w:'
local HOLD_FIELD = 'hold'
local INFO_SEPARATOR = '|'
local RECORD_SEPARATOR = '\n'
-- the weight of a waiter "*<w>*<id>" and of a token "<token>*<w>"; a wake address of a sharded
-- listener, and one of a cluster listener without sharded pub/sub (see notify)
local WEIGHTED_WAITER_PATTERN = '^%*(%d+)%*'
local WEIGHTED_TOKEN_PATTERN = '%*(%d+)$'
local SHARDED_ADDRESS_PATTERN = ':wake:s%.[^:]*$'
local CLUSTER_ADDRESS_PATTERN = ':wake:c%.[^:]*$'

-- keys outlive the last deadline they hold by this much, so a reader right at a deadline sees
-- a consistent set instead of half-expired keys
local GRACE_MS = 1000

-- how long an offered waiter has to claim its slot before the slot goes on to the next one
local CLAIM_MS = 2000

-- most entries one purge step removes: a purge never grows with the length of the line
local PURGE_STEP = 100

-- the ticket counter only breaks ties within one millisecond: it may vanish quickly
local TICKET_TTL_MS = 1000

-- PEXPIRE ... GT exists from Redis 7.0, which is also where REDIS_VERSION_NUM appears (and
-- SPUBLISH, see notify)
local HAS_GT = redis.REDIS_VERSION_NUM ~= nil

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function current_limit(default)
  local override = redis.call('GET', K_LIMIT)
  if override then
    return tonumber(override)
  end
  return default
end

-- Make sure "key" lives at least ttl_ms more, never shortening a longer expiry (holders with
-- different lease lengths share the key). is_new: the script created the key, so it has no
-- expiry yet (GT treats "no expiry" as infinite and would refuse to set one).
local function extend(key, ttl_ms, is_new)
  if is_new then
    redis.call('PEXPIRE', key, ttl_ms)
  elseif HAS_GT then
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

-- Put a holder in: the one way a slot is taken (grant, claim, reclaim).
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

-- @rest-of-lib
-- The rest: the line, offers and hand-off, wake-ups, purges, several semaphores. A script that
-- has this marker line in its own text gets what follows there (after its fast path), any other
-- script here, before its body (scripts.script_source).

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
-- 8 keys per semaphore, in the order above, semaphore after semaphore. use_semaphore(i) points
-- every helper at the i-th of them (1-based): the helpers read these locals, so one
-- script reuses them for each semaphore in turn. The single-semaphore scripts never call it.
local function use_semaphore(i)
  local b = (i - 1) * 8
  K_HOLDERS, K_HOLDER_INFO, K_QUEUE, K_PRESENT, K_DEADLINES, K_WAITER_INFO, K_TICKET, K_LIMIT =
    KEYS[b + 1], KEYS[b + 2], KEYS[b + 3], KEYS[b + 4], KEYS[b + 5], KEYS[b + 6], KEYS[b + 7], KEYS[b + 8]
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
-- A waiter nobody heard (no subscriber: its process is gone, a pool child recycled by
-- max_tasks_per_child say, or its listener is reconnecting) is added to "unheard", which the
-- scripts that hand slots on return: their caller sends a parked task's wake copy itself
-- (_parking.wake_unheard), so the offer is claimed in milliseconds instead of lapsing. PUBLISH
-- on a cluster counts only this node's subscribers: an address marked "c." (a cluster listener
-- without sharded pub/sub, _wakeups.CLUSTER_MARK) is never judged unheard.
local unheard = {}
local function notify(address, waiter)
  if address and address ~= '' then
    local heard
    if HAS_GT and string.find(address, SHARDED_ADDRESS_PATTERN) then
      heard = redis.call('SPUBLISH', address, waiter)
    else
      heard = redis.call('PUBLISH', address, waiter)
      if string.find(address, CLUSTER_ADDRESS_PATTERN) then
        heard = 1
      end
    end
    if heard == 0 then
      unheard[#unheard + 1] = waiter
    end
  end
end

local function wake_address(waiter)
  local info = redis.call('HGET', K_WAITER_INFO, WAITER_FIELD .. waiter)
  if info then
    return string.match(info, '^%d*|(.*)$')
  end
  return nil
end

local function prefixed(items, prefix)
  local out = {}
  for i = 1, #items do
    out[i] = prefix .. items[i]
  end
  return out
end

-- When the line has emptied, its counter goes at once; the rest of its bookkeeping (the hold
-- average) goes too once nobody holds either, so an idle semaphore leaves no key behind. While
-- holders remain, the average is kept for the next line: releases keep updating it.
local function forget_line_if_empty()
  if redis.call('ZCARD', K_QUEUE) == 0 then
    redis.call('DEL', K_TICKET)
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
  redis.call('HDEL', K_WAITER_INFO, WAITER_FIELD .. waiter)
  forget_line_if_empty()
  return left
end

-- One bounded step of removing lapsed holders, lapsed offers and waiters that stopped asking.
-- Returns how many holder entries (leases or offers) went, i.e. how many slots it freed.
local function purge(now)
  local dead = redis.call('ZRANGEBYSCORE', K_HOLDERS, -now, now, 'LIMIT', 0, PURGE_STEP)
  if #dead > 0 then
    redis.call('ZREM', K_HOLDERS, unpack(dead))
    redis.call('HDEL', K_HOLDER_INFO, unpack(prefixed(dead, HOLDER_FIELD)))
  end
  local gone = redis.call('ZRANGEBYSCORE', K_DEADLINES, '-inf', now, 'LIMIT', 0, PURGE_STEP)
  if #gone > 0 then
    redis.call('ZREM', K_DEADLINES, unpack(gone))
    redis.call('ZREM', K_QUEUE, unpack(gone))
    redis.call('ZREM', K_PRESENT, unpack(gone))
    redis.call('HDEL', K_WAITER_INFO, unpack(prefixed(gone, WAITER_FIELD)))
    -- an offer never outlives its waiter's place (its claim deadline is capped by it), but a
    -- waiter that lapsed must not keep a slot either way
    redis.call('ZREM', K_HOLDERS, unpack(prefixed(gone, OFFER_MARK)))
    forget_line_if_empty()
  end
  return #dead
end

-- Offer a free slot to one present waiter: it leaves the present set (it is not offered twice)
-- but keeps its place in the queue, so that if it claims too late it still comes back first.
-- Returns the claim deadline.
local function offer(waiter, now)
  local claim_by = now + CLAIM_MS
  local must_ask_by = tonumber(redis.call('ZSCORE', K_DEADLINES, waiter))
  if must_ask_by and must_ask_by < claim_by then
    claim_by = must_ask_by
  end
  redis.call('ZREM', K_PRESENT, waiter)
  redis.call('ZADD', K_HOLDERS, -claim_by, OFFER_MARK .. waiter)
  notify(wake_address(waiter), waiter)
  return claim_by
end

-- Hand free slots to the oldest present waiters, one offer each, each told alone. "except" (a
-- waiter asking in this very script) is not offered: the caller grants it directly. Returns
-- (slots still free, whether "except" was among the first in line for them, offers made).
local function hand_off(now, limit, except)
  local size = redis.call('ZCARD', K_HOLDERS)
  local free = limit - size
  if free <= 0 then
    return free, false, 0
  end
  local first = redis.call('ZRANGE', K_PRESENT, 0, free - 1)
  local latest, chosen, offered = 0, false, 0
  for i = 1, #first do
    local weight = multi_weight(first[i])
    if weight then
      -- a waiter of several slots or semaphores heads the rest of the line: it is told when
      -- its weight fits here, and nobody behind it is served before it
      if free >= weight then
        notify(wake_address(first[i]), first[i])
      end
      free = 0
      break
    end
    if first[i] == except then
      chosen = true
    else
      latest = math.max(latest, offer(first[i], now))
      offered = offered + 1
    end
    free = free - 1
  end
  if offered > 0 then
    extend(K_HOLDERS, latest - now + GRACE_MS, size == 0)
  end
  return free, chosen, offered
end

-- Purge one step, then hand freed slots on. The common ending of every script that may have
-- freed a slot.
local function settle(now, limit)
  purge(now)
  if redis.call('ZCARD', K_PRESENT) > 0 then
    hand_off(now, limit, nil)
  end
end

-- Keep the waiter-side keys alive at least ttl_ms more.
local function extend_line(ttl_ms)
  extend(K_QUEUE, ttl_ms, false)
  extend(K_PRESENT, ttl_ms, false)
  extend(K_DEADLINES, ttl_ms, false)
  extend(K_WAITER_INFO, ttl_ms, false)
end
