-- Helpers for tenants: two levels (org, user) and a cap on one tenant's holders (per_tenant),
-- built into every script with the rest of _lib.lua (in front of it: forget_line_if_empty and
-- hand_off call them).
--   KEYS    none of its own. The levels key, "<base>:levels" (levels_key(), named from KEYS[1], in
--           its hash tag), is not passed: any script that hands a slot on may read it (hand_off,
--           org_turn), and none can know beforehand whether the line holds such waiters.
--           ZSET, every score 0, read by lex range: the waiters of two-level tenants by org and
--           user tag, "o|<org>|<user tag>|<user>|<waiter>", and by user, "u|<org>|<user>|<user
--           tag>|<waiter>" (tags zero-padded to 20 digits). Entries of waiters gone from the
--           line are dropped when a scan meets them; the key goes with the line's counter when
--           the line empties. A waiter's org is kept under TENANT_FIELD in KEYS[6].
--           Under a per_tenant cap, KEYS[2] keeps each tenant's slots under HELD_FIELD (see
--           held_count), and KEYS[6] every waiter's tenant under TENANT_FIELD.
--   ARGV    none: it only defines locals.
-- Returns nothing: it runs inside each script, as _lib.lua does.
--
-- Two-level tenants (org, user; see tenant_ticket in acquire.lua). The line orders waiters by
-- their org's virtual time alone, fixed when each joins: that keeps orgs exactly fair, whatever
-- number of user names an org spreads its calls over. Which of an org's waiters takes a start
-- that falls to the org is chosen when the start is handed on (org_turn): the one whose user is
-- furthest behind, by a second virtual time over the org's users kept in the levels key (see
-- the key schema). A two-level waiter's ticket ends in LEVELED_TICKET: the hand-off sees that in
-- the score it reads anyway, so a line without such waiters pays nothing for them.
local LEVELED_TICKET = 0.5
-- most entries a look at one org's waiters reads: waiters away from the line are skipped, and
-- entries of waiters gone from it are dropped on the way
local LEVELS_SCAN = 16
-- the width of a user tag in the levels key's members, so that lex order is numeric order
local TAG_FORMAT = '%020.0f'
-- the levels key lives this long after the last waiter placed in it or chosen from it (a parked
-- Celery task may wait hours without asking)
local LEVELS_TTL_MS = 3600000

local function levels_key()
  return string.sub(K_HOLDERS, 1, -8) .. 'levels'  -- "<base>:holders" -> "<base>:levels"
end

local function is_leveled(score)
  return string.find(score, '.', 1, true) ~= nil
end

-- Whether a hand-off's first waiters ("waiter, ticket, ..." as ZRANGE WITHSCORES gives them)
-- hold a two-level one: its start's waiter is then chosen by org_turn, which may swap places
-- with a waiter further back, so the hand-off takes one waiter at a time (present_window).
local function any_leveled(first)
  for i = 2, #first, 2 do
    if is_leveled(first[i]) then
      return true
    end
  end
  return false
end

-- A cap on one tenant's slots (the rules' per_tenant; with two levels, the org's). A tenant's
-- slots are listed in KEYS[2] under HELD_FIELD .. tenant, a JSON list of the tokens granted to
-- its waiters and the offers ("!<waiter>") made to them. The list is never told of a release, a
-- lapse or a claim: a count reads each entry's score in KEYS[1] (a live holder scores above
-- now, a live offer below -now) and keeps the live ones only, so it cannot drift. A list holds
-- about the cap and what ended since the tenant's last count; the field goes once it is empty,
-- and the whole hash expires with the holders (a lease after the latest grant).
-- A waiter's tenant is kept under TENANT_FIELD in KEYS[6] when it joins a capped key.

-- most present waiters a hand-off under a cap looks at for one whose tenant is below its cap
local CAP_SCAN = 32

-- caps: the counts read so far by this script run, tenant -> {count, list}
local function held_count(caps, tenant, now)
  local held = caps[tenant]
  if held then
    return held.count
  end
  local field = HELD_FIELD .. tenant
  local listed = redis.call('HGET', K_HOLDER_INFO, field)
  local live = {}
  if listed then
    local entries = cjson.decode(listed)
    for i = 1, #entries do
      local score = tonumber(redis.call('ZSCORE', K_HOLDERS, entries[i]))
      if score and (score > now or score < -now) then
        live[#live + 1] = entries[i]
      end
    end
    if #live == 0 then
      redis.call('HDEL', K_HOLDER_INFO, field)
    elseif #live < #entries then
      redis.call('HSET', K_HOLDER_INFO, field, cjson.encode(live))
    end
  end
  caps[tenant] = {count = #live, list = live}
  return #live
end

-- A slot given to one of "tenant"'s waiters: "entry" is its token (a grant) or its offer mark.
local function note_held(caps, tenant, entry, now)
  held_count(caps, tenant, now)
  local held = caps[tenant]
  held.list[#held.list + 1] = entry
  held.count = held.count + 1
  redis.call('HSET', K_HOLDER_INFO, HELD_FIELD .. tenant, cjson.encode(held.list))
end

-- The tenant a waiter of a capped key waits for (nil: none, or it joined before the cap).
local function tenant_of(waiter)
  return redis.call('HGET', K_WAITER_INFO, TENANT_FIELD .. waiter) or nil
end

-- The tenant of an acquire's tenant argument ("<share>|<tenant>"; with two levels, the org of
-- "<share>|<org>|<user share>|<user>"), or nil for none.
local function tenant_named(tenant_arg)
  return string.match(tenant_arg, '^[^|]+|([^|]*)') or nil
end

-- A slot given to "waiter" outside a hand-off (its own ask claimed or took it): listed under
-- its tenant as "entry" (its token, or its offer mark) on a capped key. Before the waiter is
-- dropped from the line, which forgets its tenant. "caps": the counts a hand-off of the same
-- script read (nil: none), so that they are not read twice.
local function note_grant(r, waiter, entry, now, caps)
  local tenant = r.per_tenant > 0 and tenant_of(waiter)
  if tenant then
    note_held(caps or {}, tenant, entry, now)
  end
end

-- The hand-off's candidates: the first "free" present waiters ("waiter, ticket, ..."), or
-- under a cap ("caps" not nil) the first CAP_SCAN, so that it can pass over those whose tenant
-- holds its cap.
local function present_window(caps, free)
  return redis.call('ZRANGE', K_PRESENT, 0, (caps and CAP_SCAN or free) - 1, 'WITHSCORES')
end

-- Under a cap: whether the hand-off passes over "waiter" (its tenant holds its cap), and its
-- tenant.
local function capped_out(caps, waiter, r, now)
  local tenant = caps and tenant_of(waiter)
  return tenant and held_count(caps, tenant, now) >= r.per_tenant, tenant
end

-- A slot the hand-off gave "tenant"'s "waiter": an offer is listed now; the waiter granted in
-- its own script ("offered" false) is counted here and listed by its caller under its token.
local function note_given(caps, tenant, waiter, offered, now)
  if not tenant then
    return
  elseif offered then
    note_held(caps, tenant, OFFER_MARK .. waiter, now)
  else
    caps[tenant].count = caps[tenant].count + 1
  end
end

-- The levels key's members (see the key schema): the start of an org's entries, of a user's,
-- and both entries of one waiter.
local function org_prefix(org)
  return table.concat({'o', org, ''}, INFO_SEPARATOR)
end
local function user_prefix(org, user)
  return table.concat({'u', org, user, ''}, INFO_SEPARATOR)
end
local function level_entries(org, tag, user, waiter)
  return org_prefix(org) .. table.concat({tag, user, waiter}, INFO_SEPARATOR),
         user_prefix(org, user) .. tag .. INFO_SEPARATOR .. waiter
end

-- The entries of a waiter gone from the line.
local function drop_level_entries(org, tag, user, waiter)
  redis.call('ZREM', levels_key(), level_entries(org, tag, user, waiter))
end

-- The first of org's waiters by user tag that is still in line: its tag, and, if it is present
-- (asking), its id and ticket. "present_only": skip waiters away from the line (the hand-off);
-- otherwise the first one in line, present or not, gives the org's current user tag.
local function org_front(org, present_only)
  local prefix = org_prefix(org)
  local entries = redis.call('ZRANGE', levels_key(), '[' .. prefix, '[' .. prefix .. '\255', 'BYLEX',
                             'LIMIT', 0, LEVELS_SCAN)
  for i = 1, #entries do
    local tag, user, waiter = string.match(string.sub(entries[i], #prefix + 1), '^(%d+)|([^|]*)|(.*)$')
    local ticket = redis.call('ZSCORE', K_PRESENT, waiter)
    if ticket then
      return tonumber(tag), waiter, ticket
    elseif not redis.call('ZSCORE', K_QUEUE, waiter) then
      drop_level_entries(org, tag, user, waiter)
    elseif not present_only then
      return tonumber(tag), nil, nil
    end
  end
  return nil, nil, nil
end

-- The waiter that takes the start the line hands "candidate" (a present waiter at the head,
-- with its ticket): itself, unless it is a two-level waiter (its ticket ends in LEVELED_TICKET);
-- then the first present waiter of its org by user tag. When that is another, the two swap
-- places in line (tickets), so the org keeps exactly the places it had and the chosen waiter
-- stands at the head; the candidate waits on at the other's place.
local function org_turn(candidate, ticket)
  if not is_leveled(ticket) then
    return candidate
  end
  local org = redis.call('HGET', K_WAITER_INFO, TENANT_FIELD .. candidate)
  if not org then
    return candidate
  end
  local _, chosen, chosen_ticket = org_front(org, true)
  extend(levels_key(), LEVELS_TTL_MS, false)
  if not chosen or chosen == candidate then
    return candidate
  end
  redis.call('ZADD', K_QUEUE, ticket, chosen, chosen_ticket, candidate)
  redis.call('ZADD', K_PRESENT, ticket, chosen, chosen_ticket, candidate)
  return chosen
end
