-- move_due_copies: on the Redis broker, keep waiting tasks' due-later copies in the broker's
-- Redis and move each to its queue when it is due (_celery/due_copies.py). Atomic: a copy is in
-- exactly one of its backstop list, the store or its target queue at every moment, whoever
-- runs this and whenever that process dies.
--   KEYS[1] due     ZSET  copy id -> when it is due (this server's ms): kept in buckets
--                   "<due key>:<n>" with an index "<due key>-buckets" (_due_buckets.lua), this
--                   key only the release before's
--   KEYS[2] copies  HASH  copy id -> "<target list key>\n<message as kombu wrote it>", or packed
--                   by its sender: "<target list key>\n\1<stencil digest>\0<fills>" (stow_copy.lua)
--   KEYS[3] epoch   STRING the semaphore Redis's epoch last seen here
--   KEYS[4] finished ZSET run id -> until when it is remembered as finished (finish, in
--                   due_copies.py): a copy of a finished run is not stored
--   KEYS[5] moved   ZSET  copy id -> when it was moved to its queue (this server's ms), until a
--                   copy of its run asks again (stowed anew, granted) or it is withdrawn
--   KEYS[6] sent    HASH  copy id -> what was moved, as in KEYS[2]
--   KEYS[7] stencils HASH stencil digest -> stencil (_celery/packing.py)
--   KEYS[8] kept    ZSET  stencil digest -> until when it is kept (this server's ms)
--   KEYS[9..] pairs: a backstop list kombu publishes to, then the list its copies go to when due
--   ARGV[1] most    copies to stow per list, and to move, in this call
--   ARGV[2] epoch   the semaphore Redis's epoch now, or "" (not looked at in this call)
--   ARGV[3] keep_ms how long a moved copy is kept for a restart of the semaphore Redis
--   ARGV[4] stencil_keep_ms how long a stencil outlives the copies that name it; "": this call
--                   is for the store of an earlier release (whole messages), and leaves the
--                   stencils alone
--   ARGV[5..] per pair: the backstop queue's name and the target queue's name, JSON-quoted
-- Returns {moved, stowed, next_due_in_ms (-1: nothing stored), flushed (1: the semaphore Redis
-- was found restarted, and every stored copy, and every copy moved within keep_ms that no copy
-- of its run has asked since, was made due now), unreadable (copies whose stencil is not kept:
-- left stored, due again in a minute)}.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stamp = t[1] .. '.' .. t[2]  -- in the delivery tag of each copy sent (_packed.lua)
local most = tonumber(ARGV[1])

-- 0. A moved copy kept longer than keep_ms is forgotten: it was dropped as its run had finished
--    (no copy of the run asked again), or it was lost and a sweep of its parked record sent it.
local keep_ms = tonumber(ARGV[3])
local old = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now - keep_ms, 'LIMIT', 0, most)
if #old > 0 then
  redis.call('ZREM', KEYS[5], unpack(old))
  redis.call('HDEL', KEYS[6], unpack(old))
end

-- 1. A semaphore Redis that came back empty forgot every line and parked wait: nothing would
--    wake a stored copy before it is due, so all become due now. So does every copy moved lately
--    that no copy of its run has asked since: kombu's Redis transport loses a message that the
--    BRPOP of a worker being killed popped, and the parked record whose sweep would have sent it
--    again was lost with the rest.
local flushed = 0
if ARGV[2] ~= '' then
  local seen = redis.call('GET', KEYS[3])
  if seen ~= ARGV[2] then
    redis.call('SET', KEYS[3], ARGV[2])
    if seen then
      all_due_now(KEYS[1])
      for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], now - keep_ms, '+inf')) do
        local sent = redis.call('HGET', KEYS[6], id)
        if sent and redis.call('HEXISTS', KEYS[2], id) == 0 then  -- one stored again is kept instead
          set_due(KEYS[1], 0, id)
          redis.call('HSET', KEYS[2], id, sent)
        end
      end
      redis.call('DEL', KEYS[5], KEYS[6])
      flushed = 1
    end
  end
end

-- 2. Stow what kombu published to the backstop lists: due its header's seconds from now, under
--    its id (a newer copy of one wait replaces the older), routed as its target queue's message;
--    a copy of a run that finished meanwhile (its sender was refused as another copy ran) is
--    dropped. A copy of the run moved earlier has asked again: it is kept no longer.
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
local stowed = 0
for i = 9, #KEYS, 2 do
  local source, target = KEYS[i], KEYS[i + 1]
  local from_name, to_name = ARGV[i - 4], ARGV[i - 3]
  for _ = 1, most do
    local message = redis.call('RPOP', source)
    if not message then
      break
    end
    local ok, decoded = pcall(cjson.decode, message)
    local headers = ok and type(decoded) == 'table' and type(decoded.headers) == 'table' and decoded.headers or {}
    local id = headers.csem_backstop or headers.semaphore_backstop  -- the old name: an earlier release's
    if type(id) ~= 'string' or id == '' then
      id = '?' .. now .. ':' .. stowed .. ':' .. source
    end
    local due_in = tonumber(headers.csem_due_in or headers.semaphore_due_in) or 0
    local at = string.find(message, '"routing_key": ' .. from_name, 1, true)
    if at then
      local cut = at + string.len('"routing_key": ') - 1
      message = string.sub(message, 1, cut) .. to_name .. string.sub(message, cut + string.len(from_name) + 1)
    end
    if not redis.call('ZSCORE', KEYS[4], id) then
      set_due(KEYS[1], now + math.floor(due_in * 1000), id)
      redis.call('HSET', KEYS[2], id, target .. '\n' .. message)
    end
    redis.call('ZREM', KEYS[5], id)
    redis.call('HDEL', KEYS[6], id)
    stowed = stowed + 1
  end
end

-- 3. Move what is due to its queue, as kombu would have published it there, and keep it until a
--    copy of its run asks again (step 1 sends it again if the semaphore Redis restarts first).
--    The stencil of a packed copy is kept for as long as the copy is kept as moved.
local stencil_keep_ms = tonumber(ARGV[4])
local done, unreadable = {}, 0
local function move(id)
  local stored = redis.call('HGET', KEYS[2], id)
  local target, message, digest
  if stored then
    target, message, digest = stored_message(stored, KEYS[7], id, stamp)
  end
  if stored and not message then
    unreadable = unreadable + 1
    set_due(KEYS[1], now + 60000, id)
  else
    if stored then
      redis.call('LPUSH', target, message)
      if string.sub(id, 1, 1) ~= '?' then  -- a copy with no run: nothing would ever ask for it
        redis.call('ZADD', KEYS[5], now, id)
        redis.call('HSET', KEYS[6], id, stored)
        if digest and stencil_keep_ms then
          redis.call('ZADD', KEYS[8], 'GT', now + keep_ms + stencil_keep_ms, digest)
        end
      end
    end
    done[#done + 1] = id
  end
end
local taken = take_due(KEYS[1], now, most, move)
if #done > 0 then
  redis.call('HDEL', KEYS[2], unpack(done))
end

-- 4. Forget the stencils no copy names any more: kept past the due time of every copy stowed
--    with them and the keeping of every copy moved, and only once nothing due is left to move.
if stencil_keep_ms and taken < most then
  local stale = redis.call('ZRANGEBYSCORE', KEYS[8], '-inf', now, 'LIMIT', 0, most)
  if #stale > 0 then
    redis.call('ZREM', KEYS[8], unpack(stale))
    redis.call('HDEL', KEYS[7], unpack(stale))
  end
end

local first = first_due(KEYS[1])
local next_in = -1
if first then
  next_in = math.max(0, first - now)
end
return {#done, stowed, next_in, flushed, unreadable}
