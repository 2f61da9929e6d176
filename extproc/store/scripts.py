"""The Lua scripts the Redis store runs: one per tenant exchange, one per heartbeat.

Each is atomic on Redis's side and touches one key (the exchange) or two (the
registry), so a round trip costs one EVALSHA. Numbers travel as strings formatted
``%.17g``: Lua's own number-to-string keeps 14 digits, and a Lua number returned to
Redis is truncated to an integer.
"""

from __future__ import annotations

# KEYS[1]: the tenant's bucket hash, KEYS[2]: the replica registry (its live count
# comes back with every answer, so slices and local shares use a fresh one). Bucket fields: tl/rl (token/request level),
# ts (time of the levels), tc/tr and rc/rr (capacity and refill rate per second).
# Per holder h (replica id and epoch): g/q (tokens/requests granted, cumulative),
# s/u (spent from those, as h last reported), c/d/v (credit, token debit, request
# debit applied, cumulative), e (lease deadline), x (last seen). What an exchange
# admits is spent by the holder at once (s/u include it); only the slice is a lease.
#
# Cumulative counters make a retry harmless: a reply lost to a timeout leaves Redis
# ahead of the holder, and the next exchange, sent with the same counters, applies
# only the difference and credits back the grant the holder never saw.
EXCHANGE = r"""
-- ARGV: holder, now ('' = Redis TIME), the numbers below space-separated (one
-- argument: redis-py encodes each argument on its own, in Python), the costs.
local h = ARGV[1]
local A = {ARGV[1], ARGV[2]}
for x in string.gmatch(ARGV[3], '%S+') do A[#A + 1] = x end
local now
if ARGV[2] ~= '' then now = tonumber(ARGV[2]) else
  local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local tc, trate, rc, rrate = tonumber(A[3]), tonumber(A[4]), tonumber(A[5]), tonumber(A[6])
local st, sr = tonumber(A[7]), tonumber(A[8])
local cred, deb, debr = tonumber(A[9]), tonumber(A[10]), tonumber(A[11])
local cbase, dbase, rbase = tonumber(A[12]), tonumber(A[13]), tonumber(A[14])
local headroom, ttl, live = tonumber(A[15]), tonumber(A[16]), math.max(1, tonumber(A[17]))
local cap_t, cap_r, want, grace = tonumber(A[18]), tonumber(A[19]), A[20] == '1', tonumber(A[21])
-- A bucket Redis does not have starts from the caller's estimate: full for a new
-- tenant, the last level it saw (refilled since) when Redis restarted empty.
local init_t, init_r = tonumber(A[22]), tonumber(A[23])
-- Debits this holder made on its local share (Redis unreachable), cumulative and the
-- base it last had confirmed, and its estimate of the level before the cap (init_raw).
local down, down0, init_raw = tonumber(A[24]), tonumber(A[25]), tonumber(A[26])

local raw = redis.call('HGETALL', KEYS[1])
local f = {}
for i = 1, #raw, 2 do f[raw[i]] = raw[i + 1] end
local function num(k, d) local v = f[k]; if v == nil then return d end; return tonumber(v) end

-- Leases are tokens already taken out of the level: level + every live lease <=
-- capacity. Unspent is what each holder last reported; expired leases count as spent.
-- The refill since ts is capped by the room as it was then (leases live at ts, spent
-- as last reported): what a holder spent since, Redis learns now, so the room it
-- frees refills from now on, never retroactively.
local ts = num('ts', now)
local out_t, out_r, held_t, held_r = 0, 0, 0, 0
for k, v in pairs(f) do
  if string.sub(k, 1, 2) == 'x:' then
    local o = string.sub(k, 3)
    local e = num('e:'..o, 0)
    if o ~= h and tonumber(v) + grace < now then
      redis.call('HDEL', KEYS[1], 'g:'..o, 'q:'..o, 's:'..o, 'u:'..o, 'c:'..o, 'd:'..o, 'v:'..o, 'e:'..o, 'x:'..o,
                 'o:'..o)
    elseif e > ts then
      local ut = math.max(0, num('g:'..o, 0) - num('s:'..o, 0))
      local ur = math.max(0, num('q:'..o, 0) - num('u:'..o, 0))
      held_t, held_r = held_t + ut, held_r + ur
      if o ~= h and e > now then out_t, out_r = out_t + ut, out_r + ur end
    end
  end
end
local mine_t, mine_r = 0, 0
if num('e:'..h, 0) > now then
  mine_t = math.max(0, num('g:'..h, 0) - st)
  mine_r = math.max(0, num('q:'..h, 0) - sr)
end

-- Refill at the stored rate up to now, then take the new capacity and rate.
local tl, rl = num('tl', math.min(tc, init_t)), num('rl', math.min(rc, init_r))
local dt = math.max(0, now - ts)
local function refill(level, cap, rate, held)
  local room = cap - held
  if level >= room then return level end
  return math.min(room, level + rate * dt)
end
-- The refill the cap threw away over a gap of a second or more (an outage: nobody
-- reached Redis), kept for a second: the local shares spent from that same refill
-- while Redis was away, so their debits are forgiven up to it (else they are charged
-- twice, and the tenant refused for about D - B / r after an outage of D).
local w = num('w', 0)
if now - num('wt', 0) > 1 then w = 0 end
if f['tl'] == nil then
  w = math.max(0, init_raw - tc)
elseif dt >= 1 then
  local room = num('tc', tc) - held_t
  w = math.max(0, tl + num('tr', trate) * dt - math.max(tl, room))
end
if w > 0 and (f['tl'] == nil or dt >= 1) then redis.call('HSET', KEYS[1], 'wt', string.format('%.17g', now)) end
tl = refill(tl, num('tc', tc), num('tr', trate), held_t)
rl = refill(rl, num('rc', rc), num('rr', rrate), held_r)
-- This holder's unspent lease comes back; the level is clamped to the (new) room.
tl = math.min(tc - out_t, tl + mine_t)
rl = math.min(rc - out_r, rl + mine_r)
-- Settles: refunds and excess netted (they happened within one flush; a local share's
-- pre-charge and its refund arrive together), then capped at the room; a net excess
-- and owed charges in full (debt).
local refund = math.max(0, cred - num('c:'..h, cbase))
local excess = math.max(0, deb - num('d:'..h, dbase))
local owed_r = math.max(0, debr - num('v:'..h, rbase))
local net = excess - refund
local forgive = math.min(math.max(0, down - num('o:'..h, down0)), w, math.max(0, net))
net, w = net - forgive, w - forgive
tl = math.min(tc - out_t, tl - net)
rl = rl - owed_r

local res = {}
local gt, gr = 0, 0
for x in string.gmatch(ARGV[4], '%S+') do
  local cost = tonumber(x)
  local need = math.min(tc, cost + headroom)
  local tw, rw = 0, 0
  -- 1e-9: levels round-trip through strings; a hair of rounding must not refuse
  if need - tl > 1e-9 then tw = (need - tl) / math.max(trate, 1e-9) end
  if 1 - rl > 1e-9 then rw = (1 - rl) / math.max(rrate, 1e-9) end
  if tw == 0 and rw == 0 then
    tl = tl - cost; rl = rl - 1; gt = gt + cost; gr = gr + 1
  end
  res[#res + 1] = string.format('%.17g', tw)
  res[#res + 1] = string.format('%.17g', rw)
end

-- The lease: a slice that shrinks to nothing as the bucket nears empty.
local slt, slr = 0, 0
if want then
  slt = math.floor(math.min(cap_t, math.max(0, tl - headroom) / (2 * live)))
  slr = math.floor(math.min(cap_r, math.max(0, rl) / (2 * live)))
  if slt < 1 or slr < 1 then slt, slr = 0, 0 end
  tl = tl - slt; rl = rl - slr
end
local function fmt(x) return string.format('%.17g', x) end
redis.call('HSET', KEYS[1], 'tl', fmt(tl), 'rl', fmt(rl), 'ts', fmt(math.max(num('ts', now), now)),
  'tc', fmt(tc), 'tr', fmt(trate), 'rc', fmt(rc), 'rr', fmt(rrate),
  'g:'..h, fmt(st + gt + slt), 'q:'..h, fmt(sr + gr + slr), 's:'..h, fmt(st + gt), 'u:'..h, fmt(sr + gr),
  'c:'..h, fmt(cred), 'd:'..h, fmt(deb), 'v:'..h, fmt(debr), 'e:'..h, fmt(now + ttl), 'x:'..h, fmt(now),
  'o:'..h, fmt(down), 'w', fmt(w))
local full = ttl
if tl < tc then full = math.max(full, (tc - tl) / math.max(trate, 1e-6)) end
if rl < rc then full = math.max(full, (rc - rl) / math.max(rrate, 1e-6)) end
redis.call('PEXPIRE', KEYS[1], math.ceil(math.min(full + 60, 604800) * 1000))
local alive = redis.call('ZCOUNT', KEYS[2], '(' .. fmt(now), '+inf')
local out = {fmt(tl), fmt(rl), fmt(st + gt + slt), fmt(sr + gr + slr), tostring(alive)}
for i = 1, #res do out[#out + 1] = res[i] end
return out
"""

# KEYS[1]: the replica sorted set (score: Redis-time deadline), KEYS[2]: the epoch
# counter, KEYS[3]: each registering process's token -> the member it was last given.
# ARGV: replica id, member held ('' to register), ttl, now ('' = TIME), token.
# A member that expired is fenced: it gets a new epoch and must drop what it held.
# Registering is idempotent per token: a heartbeat that timed out on the replica's side
# may still have run (Redis slow, or frozen and back) and registered a member the
# replica never heard of; the retry gets that member rather than a second one (else it
# counts as a replica for a ttl: the live count, and the registered replicas a
# recovering slot lease waits for, extproc.store.slot_leases). Not by replica id: two
# processes may share one (it defaults to the host name). A member's name carries the
# Redis time it was given, not only the epoch: a Redis restarted empty counts epochs from
# 0 again and handed a replica its old name back, so when the answer to the heartbeat that
# fenced it was lost (timed out while Redis came back), the next found "its" member and
# reported no fence: the replica never recovered its slot leases (seen once in
# test_fleet_redis_down[killed]).
HEARTBEAT = r"""
local now
if ARGV[4] ~= '' then now = tonumber(ARGV[4]) else
  local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.17g', now))
local member, fenced = ARGV[2], 0
if member ~= '' and not redis.call('ZSCORE', KEYS[1], member) then member, fenced = '', 1 end
if member == '' then
  local given = redis.call('HGET', KEYS[3], ARGV[5])
  if given and redis.call('ZSCORE', KEYS[1], given) then
    member = given  -- registered by an attempt whose answer was lost: still nobody else's
  else
    local t = redis.call('TIME')
    member = ARGV[1] .. '#' .. redis.call('INCR', KEYS[2]) .. '.' .. t[1] .. string.format('%06d', tonumber(t[2]))
    redis.call('HSET', KEYS[3], ARGV[5], member)
    local raw = redis.call('HGETALL', KEYS[3])  -- forget the tokens whose members are gone
    for i = 1, #raw, 2 do
      if not redis.call('ZSCORE', KEYS[1], raw[i + 1]) and raw[i + 1] ~= member then
        redis.call('HDEL', KEYS[3], raw[i])
      end
    end
  end
end
redis.call('ZADD', KEYS[1], string.format('%.17g', now + tonumber(ARGV[3])), member)
return {member, redis.call('ZCARD', KEYS[1]), fenced}
"""
