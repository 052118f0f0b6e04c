-- _packed: the message a stored copy holds, put together from its stencil when it is packed
-- (_celery/packing.py: "\1<stencil digest>\0<fill>\0<fill>...", a fill "\2<n>" repeating fill
-- n; "\3" and "\4" standing for the copy's id and a delivery tag of its own, see below). A copy
-- stored whole (a message as kombu wrote it) is returned as it is. Returns the list the copy goes
-- to, its message (nil when its stencil is not kept) and its stencil's digest (nil for a copy
-- stored whole).
local function split_at_nul(text, from)
  local pieces = {}
  while true do
    local stop = string.find(text, '\0', from, true)
    if not stop then
      pieces[#pieces + 1] = string.sub(text, from)
      return pieces
    end
    pieces[#pieces + 1] = string.sub(text, from, stop - 1)
    from = stop + 1
  end
end

local BASE64 = {}
for i = 1, 64 do
  BASE64[i - 1] = string.sub('ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/', i, i)
end

-- text in standard base64 with padding, as kombu writes a body
local function base64(text)
  local out, n = {}, #text
  for i = 1, n, 3 do
    local a, b, c = string.byte(text, i, i + 2)
    local v = a * 65536 + (b or 0) * 256 + (c or 0)
    out[#out + 1] = BASE64[math.floor(v / 262144)] .. BASE64[math.floor(v / 4096) % 64]
      .. (b and BASE64[math.floor(v / 64) % 64] or '=') .. (c and BASE64[v % 64] or '=')
  end
  return table.concat(out)
end

-- A copy packed with marks (its last fill "\5") names its own id with "\3" and a delivery tag
-- of its own with "\4": written here as "<id>" and "<id>:<stamp>" (stamp: the server's time, so
-- that each send has a tag of its own). A reader of an earlier release counts one fill more than
-- the stencil's holes, and leaves such a copy stored rather than send the marks. A last fill
-- "\5\6" says the same of a copy with marks that reader does not know (it leaves it stored
-- too): "\7" and "\8", the task id and the run part of a Celery copy's id "<task id>#<retries>#
-- <run part>", and a body its stencil keeps as JSON text between two "\6": that text, filled, is
-- written base64.
local function stored_message(stored, stencils_key, id, stamp)
  local cut = string.find(stored, '\n', 1, true)
  local target = string.sub(stored, 1, cut - 1)
  if string.byte(stored, cut + 1) ~= 1 then
    return target, string.sub(stored, cut + 1)
  end
  local fills = split_at_nul(stored, cut + 2)  -- fills[1]: the stencil's digest
  local more = fills[#fills] == '\5\6'
  local marked = more or fills[#fills] == '\5'
  if marked then
    fills[#fills] = nil
  end
  local task_id, run_part
  if more then
    task_id, run_part = string.match(id, '^(.+)#%d+#([^#]+)$')
  end
  local stencil = redis.call('HGET', stencils_key, fills[1])
  if not stencil then
    return target, nil
  end
  local parts = split_at_nul(stencil, 1)
  if #parts ~= #fills then
    return target, nil
  end
  local whole = {parts[1]}
  for i = 2, #parts do
    local fill = fills[i]
    if string.byte(fill, 1) == 2 then
      fill = fills[tonumber(string.sub(fill, 2)) + 1]
    end
    if marked and fill == '\3' then
      fill = '"' .. id .. '"'
    elseif marked and fill == '\4' then
      fill = '"' .. id .. ':' .. stamp .. '"'
    elseif more and fill == '\7' then
      fill = task_id and '"' .. task_id .. '"'
    elseif more and fill == '\8' then
      fill = run_part and '"' .. run_part .. '"'
    end
    if not fill then
      return target, nil
    end
    whole[#whole + 1] = fill
    whole[#whole + 1] = parts[i]
  end
  local message = table.concat(whole)
  if more and string.find(stencil, '\6', 1, true) then
    local open = string.find(message, '\6', 1, true)
    local close = open and string.find(message, '\6', open + 1, true)
    if not close then
      return target, nil
    end
    message = string.sub(message, 1, open - 1) .. base64(string.sub(message, open + 1, close - 1))
      .. string.sub(message, close + 1)
  end
  return target, message, fills[1]
end
